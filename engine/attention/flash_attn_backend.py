"""Paged attention through the flash-attn package (FlashAttention-2 kernels, CUDA only).

Decode steps (every request has one query) go through ``flash_attn_with_kvcache`` with
``q`` as [B, 1, H, D]; prefill and mixed steps through ``flash_attn_varlen_func`` with the same
paged caches and ``block_table`` (flash-attn >= 2.6), ``cu_seqlens_q = query_start_loc`` and
``cu_seqlens_k`` = the running sum of ``seq_lens``. flash-attn aligns its causal mask to the
bottom-right corner (query i of a request sits at ``seqlen_k - seqlen_q + i``), which is exactly
this engine's self-attention convention; cross-attention passes ``causal=False``.

Restrictions of upstream flash-attn (2.6 - 2.8.x, FA2):
  * paged KV needs the page block size to be a multiple of 256: the docstring of
    ``flash_attn_with_kvcache`` says "page_block_size must be a multiple of 256" and
    ``flash_api.cpp`` checks ``page_block_size % 256 == 0`` ("Paged KV cache block size must be
    divisible by 256") for both entry points. Configure ``block_size: 256`` (Whisper's 1500
    encoder frames then fill 6 blocks, 1536 slots). The constructor and each call refuse other
    block sizes with a ValueError. (vLLM's fork, vllm-flash-attn, allows 16; upstream does not.)
  * fp16 / bf16 only, query and cache of the same dtype; head_dim <= 256 and a multiple of 8.
  * the caches' last dim must be contiguous; other strides (the per-layer view's block stride)
    are passed through to the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, PagedAttentionBatch

FLASH_ATTN_PAGE_MULTIPLE = 256

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    _FLASH_ATTN_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken CUDA extension (OSError / RuntimeError)
    flash_attn_varlen_func = None
    flash_attn_with_kvcache = None
    # Its text only: the exception's traceback holds the frames that first imported this module,
    # and through them whatever those frames hold (a DecoderEngine under construction, its KV
    # pool with it) for as long as the process lives.
    _FLASH_ATTN_IMPORT_ERROR = repr(exc)


def flash_attn_available() -> bool:
    """True when flash_attn (with the paged-KV entry points) imports."""
    return flash_attn_with_kvcache is not None and flash_attn_varlen_func is not None


def flash_attn_import_error() -> str:
    return _FLASH_ATTN_IMPORT_ERROR or ""


def check_flash_attn_block_size(block_size: int) -> None:
    if block_size <= 0 or block_size % FLASH_ATTN_PAGE_MULTIPLE != 0:
        raise ValueError(
            f"the flash_attn backend needs a KV block size that is a multiple of {FLASH_ATTN_PAGE_MULTIPLE} "
            f"(flash-attn's paged KV cache requirement), got block_size={block_size}; configure "
            f"block_size: {FLASH_ATTN_PAGE_MULTIPLE}, or use the 'triton' backend for small blocks"
        )


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self, block_size: int | None = None) -> None:
        if block_size is not None:
            check_flash_attn_block_size(block_size)
        if not flash_attn_available():
            raise ValueError(
                "the flash_attn backend needs the 'flash-attn' package (>= 2.6, built for this CUDA/torch), "
                f"which did not import: {flash_attn_import_error()}"
            )
        self.block_size = block_size

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedAttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        page_size = key_cache.shape[1]
        check_flash_attn_block_size(page_size)
        if query.dtype not in (torch.float16, torch.bfloat16) or key_cache.dtype != query.dtype:
            raise ValueError(
                f"flash_attn supports fp16/bf16 with query and cache of one dtype, got query {query.dtype}, "
                f"cache {key_cache.dtype}; use dtype bfloat16 or the 'triton' backend"
            )
        num_requests = batch.num_requests
        num_key_blocks = -(-batch.max_seq_len // page_size)
        block_table = batch.block_tables[:, :num_key_blocks]
        if block_table.dtype != torch.int32:
            block_table = block_table.to(torch.int32)
        seq_lens = batch.seq_lens.to(torch.int32)

        if batch.max_query_len == 1 and query.shape[0] == num_requests:
            out = flash_attn_with_kvcache(
                query.unsqueeze(1),  # [B, 1, H, D]
                key_cache,
                value_cache,
                cache_seqlens=seq_lens,
                block_table=block_table,
                softmax_scale=scale,
                causal=batch.causal,
            )
            return out.squeeze(1)

        cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=batch.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_seq_len,
            softmax_scale=scale,
            causal=batch.causal,
            block_table=block_table,
        )
