"""Tensors in, logits out: turns a scheduled batch of requests into one decoder forward.

It owns the decoder weights, the KV tensors and the attention backend; it knows nothing of
scheduling or decoding rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.kv_storage import PagedKVStorage
from engine.model import DecoderStepMetadata, Whisper
from engine.request import Request


@dataclass
class StepLogits:
    """Per scheduled request: logits of its last fed token; and of <|startoftranscript|> when fed."""

    last: torch.Tensor  # [B, vocab] float32
    at_sot: dict[int, torch.Tensor]  # batch row -> [vocab] float32


class ModelRunner:
    def __init__(self, model: Whisper, storage: PagedKVStorage, backend: AttentionBackend):
        self.model = model
        self.storage = storage
        self.backend = backend
        self.device = storage.cache.device
        self.block_size = storage.block_size

    @torch.inference_mode()
    def write_cross_kv_from_states(self, block_ids: list[int], states: torch.Tensor) -> None:
        states = states.to(self.device, next(self.model.parameters()).dtype)
        cross_kv = self.model.decoder.project_cross_kv(states.unsqueeze(0))[0]
        self.storage.write_sequence(block_ids, cross_kv)

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        # Padding entries point at block 0; kernels mask them by sequence length.
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def execute(self, requests: list[Request]) -> StepLogits:
        token_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        last_index: list[int] = []
        sot_rows: dict[int, int] = {}
        for row, request in enumerate(requests):
            start = request.num_computed_tokens
            fed = request.pending_tokens
            if start <= request.sot_index < start + len(fed):
                sot_rows[row] = len(token_ids) + request.sot_index - start
            token_ids.extend(fed)
            positions.extend(range(start, start + len(fed)))
            query_start.append(len(token_ids))
            last_index.append(len(token_ids) - 1)

        device = self.device
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        slot_table = self._table([r.blocks.self_block_ids for r in requests]).long()
        owner = torch.repeat_interleave(
            torch.arange(len(requests), device=device),
            torch.tensor([len(r.pending_tokens) for r in requests], device=device),
        )
        slot_block_ids = slot_table[owner, position_tensor // self.block_size]
        query_start_loc = torch.tensor(query_start, dtype=torch.int32, device=device)
        max_query_len = max(len(r.pending_tokens) for r in requests)
        self_lens = [r.num_computed_tokens + len(r.pending_tokens) for r in requests]
        cross_len = self.model.dims.n_audio_ctx
        meta = DecoderStepMetadata(
            positions=position_tensor,
            slot_block_ids=slot_block_ids,
            slot_offsets=position_tensor % self.block_size,
            self_attention=PagedAttentionBatch(
                query_start_loc=query_start_loc,
                seq_lens=torch.tensor(self_lens, dtype=torch.int32, device=device),
                block_tables=slot_table.int(),
                causal=True,
                max_query_len=max_query_len,
                max_seq_len=max(self_lens),
            ),
            cross_attention=PagedAttentionBatch(
                query_start_loc=query_start_loc,
                seq_lens=torch.full((len(requests),), cross_len, dtype=torch.int32, device=device),
                block_tables=self._table([r.blocks.cross_block_ids for r in requests]),
                causal=False,
                max_query_len=max_query_len,
                max_seq_len=cross_len,
            ),
        )
        hidden = self.model.decoder(torch.tensor(token_ids, device=device), meta, self.storage, self.backend)
        wanted = last_index + list(sot_rows.values())
        logits = self.model.decoder.logits(hidden[torch.tensor(wanted, device=device)]).float()
        at_sot = {row: logits[len(requests) + i] for i, row in enumerate(sot_rows)}
        return StepLogits(last=logits[: len(requests)], at_sot=at_sot)
