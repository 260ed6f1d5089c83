"""Tensors in, logits out: turns a scheduled batch of requests into one decoder forward.

It owns the decoder weights, the KV tensors, the device block tables and the attention backend;
it knows nothing of scheduling or decoding rules. A step whose requests each feed one token (a
decode-shaped step, prompt tokens included) replays a captured CUDA graph when one fits; any other
step runs eagerly. Both go through ``forward``, so the two paths compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.device_tables import DeviceBlockTables
from engine.kv_cache import blocks_needed
from engine.kv_storage import PagedKVStorage
from engine.model import DecoderStepMetadata, Whisper
from engine.request import Request


@dataclass
class StepLogits:
    """Per scheduled request: logits of its last fed token; and of <|startoftranscript|> when fed."""

    last: torch.Tensor  # [B, vocab] float32
    at_sot: dict[int, torch.Tensor]  # batch row -> [vocab] float32


@dataclass
class StepTensors:
    """One step's inputs on the device: packed tokens [T] and per-request rows [B]."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] batch row of each packed token
    slots: torch.Tensor  # [B] block-table row of each request
    query_start_loc: torch.Tensor  # [B + 1] int32
    self_lens: torch.Tensor  # [B] int32, keys after this step's writes
    cross_lens: torch.Tensor  # [B] int32
    max_query_len: int  # host-side maxima size the attention grids without a device sync
    max_self_len: int


class ModelRunner:
    def __init__(self, model: Whisper, storage: PagedKVStorage, backend: AttentionBackend, max_requests: int):
        self.model = model
        self.storage = storage
        self.backend = backend
        self.device = storage.cache.device
        self.block_size = storage.block_size
        dims = model.dims
        self.cross_len = dims.n_audio_ctx
        self.tables = DeviceBlockTables(
            max_requests,
            blocks_needed(dims.n_text_ctx, self.block_size),
            blocks_needed(dims.n_audio_ctx, self.block_size),
            storage.null_block,
            self.device,
        )
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs, when captured

    @torch.inference_mode()
    def write_cross_kv_from_states(self, block_ids: list[int], states: torch.Tensor) -> None:
        states = states.to(self.device, next(self.model.parameters()).dtype)
        cross_kv = self.model.decoder.project_cross_kv(states.unsqueeze(0))[0]
        self.storage.write_sequence(block_ids, cross_kv)

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
                seq_lens=step.cross_lens,
                block_tables=self.tables.cross_tables[step.slots],
                causal=False,
                max_query_len=step.max_query_len,
                max_seq_len=self.cross_len,
            ),
        )
        hidden = self.model.decoder(step.token_ids, meta, self.storage, self.backend)
        if logits_index is not None:
            hidden = hidden[logits_index]
        return self.model.decoder.logits(hidden).float()

    def execute(self, requests: list[Request]) -> StepLogits:
        slots = [self.tables.slot_of(request) for request in requests]
        if self.graphs is not None and self.graphs.fits(requests):
            last = self.graphs.replay(requests, slots)
            # Every row fed one token: a row that fed <|startoftranscript|> has those logits in ``last``.
            at_sot = {row: last[row] for row, r in enumerate(requests) if r.num_computed_tokens == r.sot_index}
            return StepLogits(last=last, at_sot=at_sot)
        return self._execute_eager(requests, slots)

    def _execute_eager(self, requests: list[Request], slots: list[int]) -> StepLogits:
        token_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        query_start = [0]
        self_lens: list[int] = []
        last_index: list[int] = []
        sot_rows: dict[int, int] = {}
        for row, request in enumerate(requests):
            start = request.num_computed_tokens
            fed = request.pending_tokens
            if start <= request.sot_index < start + len(fed):
                sot_rows[row] = len(token_ids) + request.sot_index - start
            token_ids.extend(fed)
            positions.extend(range(start, start + len(fed)))
            token_rows.extend([row] * len(fed))
            query_start.append(len(token_ids))
            self_lens.append(start + len(fed))
            last_index.append(len(token_ids) - 1)

        def upload(values: list[int]) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype=np.int32)).to(self.device)

        step = StepTensors(
            token_ids=upload(token_ids).long(),
            positions=upload(positions).long(),
            token_rows=upload(token_rows).long(),
            slots=upload(slots).long(),
            query_start_loc=upload(query_start),
            self_lens=upload(self_lens),
            cross_lens=torch.full((len(requests),), self.cross_len, dtype=torch.int32, device=self.device),
            max_query_len=max(len(r.pending_tokens) for r in requests),
            max_self_len=max(self_lens),
        )
        logits = self.forward(step, upload(last_index + list(sot_rows.values())).long())
        at_sot = {row: logits[len(requests) + i] for i, row in enumerate(sot_rows)}
        return StepLogits(last=logits[: len(requests)], at_sot=at_sot)
