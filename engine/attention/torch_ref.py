"""Reference paged attention in plain torch: gather each request's blocks, pad, run SDPA.

It is the CPU path and the oracle every other backend is tested against. The gather copies each
request's keys once per layer; on the GPU the Triton and flash-attn backends read blocks in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, PagedAttentionBatch


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

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
        tables = batch.block_tables[:, :num_key_blocks].long()
        # [B, M, bs, H, D] -> [B, H, M*bs, D]
        keys = key_cache[tables].reshape(num_requests, -1, num_heads, head_dim).transpose(1, 2)
        values = value_cache[tables].reshape(num_requests, -1, num_heads, head_dim).transpose(1, 2)

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
            query_pos = (batch.seq_lens - query_lens)[:, None] + torch.arange(max_q, device=query.device)[None, :]
            mask = mask & (key_pos[None, None, :] <= query_pos[:, :, None])  # [B, max_q, L]
        out = F.scaled_dot_product_attention(
            padded_query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask.unsqueeze(1), scale=scale
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2)  # [B, max_q, H, D]
        if token_valid is None:
            return out.reshape(num_requests, num_heads, head_dim)
        return out[token_valid]
