"""Tensors in, logits out: turns one step's rows (slots, fed tokens, positions) into a decoder forward.

It owns the decoder weights, the KV tensors, the device block tables and the attention backend;
it knows nothing of scheduling or decoding rules. A step whose requests each feed one token (a
decode-shaped step, prompt tokens included) replays a captured CUDA graph when one fits; any other
step runs eagerly. Both go through ``forward``, so the two paths compute the same thing.

A fed token may not be known on the host yet (``FROM_LAST_STEP``: sampled by the step launched
just before, whose tokens the host reads only after launching this one). The engine leaves each
step's tokens by row in ``next_tokens``; ``forward`` takes those from there, on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.decode.batch import StepInput
from engine.device import upload
from engine.kv.block_pool import blocks_needed
from engine.kv.block_tables import DeviceBlockTables
from engine.kv.storage import PagedKVStorage
from engine.model.whisper import DecoderStepMetadata, Whisper


@dataclass
class StepLogits:
    """Per scheduled request: logits of its last fed token; and of <|startoftranscript|> when fed."""

    last: torch.Tensor  # [B, vocab] float32
    at_sot: dict[int, torch.Tensor]  # batch row -> [vocab] float32
    slots: list[int]  # each row's block-table slot


@dataclass
class StepTensors:
    """One step's inputs on the device: packed tokens [T] and per-request rows [B]."""

    token_ids: torch.Tensor  # [T]
    token_sources: torch.Tensor  # [T] row of ``next_tokens`` to feed instead, or -1: ``token_ids``'s
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] batch row of each packed token
    slots: torch.Tensor  # [B] block-table row of each request
    query_start_loc: torch.Tensor  # [B + 1] int32
    self_lens: torch.Tensor  # [B] int32, keys after this step's writes
    max_query_len: int  # host-side maxima size the attention grids without a device sync
    max_self_len: int
    cross_readers: torch.Tensor | None = None  # [B] int32: StepInput.cross_readers, decode steps only


class ModelRunner:
    def __init__(self, model: Whisper, storage: PagedKVStorage, backend: AttentionBackend, max_requests: int):
        self.model = model
        self.storage = storage
        self.backend = backend
        self.device = storage.cache.device
        self.block_size = storage.block_size
        dims = model.dims
        self.cross_len = dims.n_audio_ctx  # the most: a window encoded over fewer frames reads fewer
        self.tables = DeviceBlockTables(
            max_requests,
            blocks_needed(dims.n_text_ctx, self.block_size),
            blocks_needed(dims.n_audio_ctx, self.block_size),
            storage.null_block,
            self.device,
        )
        # The last launched step's token by row (sampled, or a detected language): what a
        # FROM_LAST_STEP input reads. Written by the engine after sampling, read by the next step.
        self.next_tokens = torch.zeros(max_requests, dtype=torch.long, device=self.device)
        self.graphs = None  # engine.decode.step.cuda_graphs.DecodeGraphs, when captured
        # The most rows whose cross-attention one read of their shared K/V serves (1: none share).
        self.max_cross_readers = backend.max_key_readers(dims.decoder_heads, dims.head_dim)

    @torch.inference_mode()
    def project_cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """One window's encoder states [frames, d_model] -> its cross-attention K/V [layers, 2, frames,
        H, D]."""
        # The decoder's dtype: a model that still holds its encoder (colocated) may run that in bf16.
        states = states.to(self.device, next(self.model.decoder.parameters()).dtype)
        return self.model.decoder.project_cross_kv(states.unsqueeze(0))[0]

    def release(self, request_id: str) -> None:
        self.tables.release(request_id)

    @torch.inference_mode()
    def forward(self, step: StepTensors, logits_index: torch.Tensor | None) -> torch.Tensor:
        """Decoder forward for one step -> float32 logits of the rows ``logits_index`` (all if None)."""
        self_tables = self.tables.self_tables[step.slots]
        slot_block_ids = self_tables[step.token_rows, step.positions // self.block_size].long()
        meta = DecoderStepMetadata(
            positions=step.positions,
            slot_block_ids=slot_block_ids,
            slot_offsets=step.positions % self.block_size,
            self_attention=PagedAttentionBatch(
                query_start_loc=step.query_start_loc,
                seq_lens=step.self_lens,
                block_tables=self_tables,
                causal=True,
                max_query_len=step.max_query_len,
                max_seq_len=step.max_self_len,
            ),
            cross_attention=PagedAttentionBatch(
                query_start_loc=step.query_start_loc,
                seq_lens=self.tables.cross_lens[step.slots],
                block_tables=self.tables.cross_tables[step.slots],
                causal=False,
                max_query_len=step.max_query_len,
                max_seq_len=self.cross_len,
                key_readers=step.cross_readers if step.max_query_len == 1 else None,
            ),
        )
        from_last_step = step.token_sources >= 0
        token_ids = torch.where(
            from_last_step, self.next_tokens[step.token_sources.clamp(min=0)], step.token_ids
        )
        hidden = self.model.decoder(token_ids, meta, self.storage, self.backend)
        if logits_index is not None:
            hidden = hidden[logits_index]
        return self.model.decoder.logits(hidden)

    def execute(self, step: StepInput) -> StepLogits:
        slots = step.slots
        if self.graphs is not None and self.graphs.fits(step):
            last = self.graphs.replay(step)
            # Every row fed one token: a row that fed <|startoftranscript|> has those logits in ``last``.
            at_sot = {}
            if max(step.sot_offsets) >= 0:
                at_sot = {index: last[index] for index, offset in enumerate(step.sot_offsets) if offset == 0}
            return StepLogits(last=last, at_sot=at_sot, slots=slots)
        return self._execute_eager(step)

    def _execute_eager(self, step_input: StepInput) -> StepLogits:
        slots = step_input.slots
        token_ids: list[int] = []
        token_sources: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        query_start = [0]
        self_lens: list[int] = []
        last_index: list[int] = []
        sot_rows: dict[int, int] = {}
        rows = zip(step_input.tokens, step_input.sources, step_input.starts, step_input.sot_offsets)
        for index, (fed, source, start, sot_offset) in enumerate(rows):
            if sot_offset >= 0:
                sot_rows[index] = len(token_ids) + sot_offset
            if len(fed) == 1:  # a decode step's every row: appends, not lists made to extend with
                token_ids.append(fed[0])
                token_sources.append(source)
                positions.append(start)
                token_rows.append(index)
            else:
                token_ids.extend(fed)
                token_sources.extend([source] + [-1] * (len(fed) - 1))
                positions.extend(range(start, start + len(fed)))
                token_rows.extend([index] * len(fed))
            query_start.append(len(token_ids))
            self_lens.append(start + len(fed))
            last_index.append(len(token_ids) - 1)

        # One upload for every per-token and per-request list.
        count = step_input.num_rows
        host = np.asarray(
            token_ids
            + token_sources
            + positions
            + token_rows
            + slots
            + query_start
            + self_lens
            + last_index
            + list(sot_rows.values()),
            dtype=np.int64,
        )
        packed = upload(host, torch.long, self.device)
        tokens, sources, positions_t, rows_t, pieces = packed.split(
            [len(token_ids)] * 4 + [len(host) - 4 * len(token_ids)]
        )
        slots_t, query_start_t, self_lens_t, logits_index = pieces.split(
            [count, count + 1, count, len(pieces) - 3 * count - 1]
        )
        step = StepTensors(
            token_ids=tokens,
            token_sources=sources,
            positions=positions_t,
            token_rows=rows_t,
            slots=slots_t,
            query_start_loc=query_start_t.int(),
            self_lens=self_lens_t.int(),
            max_query_len=step_input.max_fed,
            max_self_len=max(self_lens),
            cross_readers=None
            if step_input.cross_readers is None
            else upload(step_input.cross_readers, torch.int32, self.device),
        )
        logits = self.forward(step, logits_index)
        at_sot = {index: logits[count + i] for i, index in enumerate(sot_rows)}
        return StepLogits(last=logits[:count], at_sot=at_sot, slots=slots)
