"""Reference paged attention in plain torch: gather each request's blocks, pad, run SDPA.

It is the CPU path and the oracle every other backend is tested against. The gather copies each
request's keys once per layer (whole blocks, into reused buffers); on the GPU the Triton and
flash-attn backends read blocks in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, PagedAttentionBatch


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # Gather destinations, reused from call to call (keys, values): a fresh tensor of a decode
        # batch's cross-attention K/V (tiny.en, 16 requests: 37 MB a layer) costs page faults on
        # every step. Calls come from one step thread at a time, and nothing keeps a gathered
        # tensor past the call.
        self._gathered: dict[str, torch.Tensor] = {}

    def gather_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, which: str) -> torch.Tensor:
        """Blocks ``block_ids`` of a per-layer view [num_blocks, bs, H, D] -> [n, bs, H, D].

        Each block's slice is contiguous inside the block-major cache, so the view is a matrix with
        one row per block and ``index_select`` copies whole rows; advanced indexing
        (``cache[ids]``) walks the strided view element by element instead, many times slower."""
        if not cache[0].is_contiguous():  # another layout: the generic gather
            return cache[block_ids]
        rows = cache.flatten(1)  # a view, [num_blocks, bs * H * D]
        size = block_ids.numel() * rows.shape[1]
        buffer = self._gathered.get(which)
        if (
            buffer is None
            or buffer.numel() < size
            or buffer.dtype != rows.dtype
            or buffer.device != rows.device
        ):
            buffer = self._gathered[which] = torch.empty(size, dtype=rows.dtype, device=rows.device)
        out = buffer[:size].view(block_ids.numel(), rows.shape[1])
        return torch.index_select(rows, 0, block_ids, out=out).view(-1, *cache.shape[1:])

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedAttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        num_requests = batch.num_requests
        block_size = key_cache.shape[1]
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_key_blocks = -(-batch.max_seq_len // block_size)
        if not batch.causal and batch.max_query_len == 1 and query.device.type == "cpu":
            # A window's beams read one copy of its cross-attention K/V: gather it once for all.
            tables, readers = torch.unique(batch.block_tables[:, :num_key_blocks], dim=0, return_inverse=True)
            if tables.shape[0] < num_requests:
                return self._shared_keys_attention(
                    query, key_cache, value_cache, batch, tables, readers, scale
                )
        # Padding entries may be any id (-1 included): they are masked below, only never out of range.
        block_ids = batch.block_tables[:, :num_key_blocks].reshape(-1).long().remainder(key_cache.shape[0])
        # [B * M, bs, H, D] -> [B, H, M*bs, D]
        keys = self.gather_blocks(key_cache, block_ids, "keys")
        values = self.gather_blocks(value_cache, block_ids, "values")
        keys = keys.reshape(num_requests, -1, num_heads, head_dim).transpose(1, 2)
        values = values.reshape(num_requests, -1, num_heads, head_dim).transpose(1, 2)

        query_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        max_q = batch.max_query_len
        if max_q == 1 and query.shape[0] == num_requests:
            padded_query = query.unsqueeze(2)  # [B, H, 1, D]
            token_valid = None
        else:
            offsets = torch.arange(max_q, device=query.device)
            token_valid = offsets[None, :] < query_lens[:, None]  # [B, max_q]
            token_index = (batch.query_start_loc[:-1, None] + offsets[None, :]).clamp(max=query.shape[0] - 1)
            padded_query = query[token_index.long()].transpose(1, 2)  # [B, H, max_q, D]

        key_pos = torch.arange(keys.shape[2], device=query.device)
        mask = key_pos[None, None, :] < batch.seq_lens[:, None, None]  # [B, 1, L]
        if batch.causal:
            query_pos = (batch.seq_lens - query_lens)[:, None] + torch.arange(max_q, device=query.device)[
                None, :
            ]
            mask = mask & (key_pos[None, None, :] <= query_pos[:, :, None])  # [B, max_q, L]
        out = F.scaled_dot_product_attention(
            padded_query,
            keys.to(query.dtype),
            values.to(query.dtype),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2)  # [B, max_q, H, D]
        if token_valid is None:
            return out.reshape(num_requests, num_heads, head_dim)
        return out[token_valid]

    def _shared_keys_attention(self, query, key_cache, value_cache, batch, tables, readers, scale):
        """One query per request, requests reading the same blocks grouped: each distinct table's
        keys and values are gathered once and attended by all its readers' queries at once."""
        num_tables, num_heads, head_dim = tables.shape[0], query.shape[1], query.shape[2]
        block_ids = tables.reshape(-1).long().remainder(key_cache.shape[0])
        keys = self.gather_blocks(key_cache, block_ids, "keys").reshape(num_tables, -1, num_heads, head_dim)
        values = self.gather_blocks(value_cache, block_ids, "values").reshape(
            num_tables, -1, num_heads, head_dim
        )
        # Each request's place among its table's readers: [table, place] in a padded query block.
        order = torch.argsort(readers, stable=True)
        counts = torch.bincount(readers, minlength=num_tables)
        first_reader = torch.cumsum(counts, 0) - counts
        place = torch.empty_like(readers)
        place[order] = torch.arange(readers.shape[0]) - first_reader[readers[order]]
        queries = query.new_zeros(num_tables, int(counts.max()), num_heads, head_dim)
        queries[readers, place] = query
        seq_lens = torch.zeros(num_tables, dtype=batch.seq_lens.dtype).index_copy_(0, readers, batch.seq_lens)
        mask = torch.arange(keys.shape[1])[None, :] < seq_lens[:, None]  # [tables, L]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            attn_mask=mask[:, None, None, :],
            scale=scale,
        )  # [tables, H, readers, D]
        return out.transpose(1, 2)[readers, place]
