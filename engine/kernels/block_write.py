"""A request's K/V written into its cache blocks by one Triton kernel (admission's second half).

Admission projects a request's encoder states to cross-attention K/V (one GEMM) and writes the
product into the request's blocks. As PyTorch copies, one per block with the cast on the way, the
write into an fp8 cache costs more than the GEMM itself (a clamp, then two casting copies, each a
full pass over the request's K/V). The kernel reads the product
once and writes each block once, clamped and cast in registers, the padding slots of the last
block zeroed.

Numerics are ``to_cache_dtype``'s: values clamp to an fp8 format's finite range, then round to
nearest. JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it
in tests.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.kernels import tl, triton, triton_available

if triton_available():

    def _write_sequence_kernel(
        SRC,
        DST,
        BLOCK_IDS,
        seq_len,
        row_width,
        src_stride_layer,
        src_stride_kv,
        src_stride_token,
        dst_stride_block,
        LIMIT: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
    ):
        # One program: ROWS slots of one block, for one layer's keys or values. The rows of a block
        # are (layer, k|v, slot) in the cache, each row_width (= H * D) elements long.
        index = tl.program_id(0)
        layer_kv = tl.program_id(1)
        block = tl.load(BLOCK_IDS + index).to(tl.int64)
        slots = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
        tokens = (index * BLOCK_SIZE + slots).to(tl.int64)
        live = tokens < seq_len
        in_block = slots < BLOCK_SIZE
        src_rows = (
            SRC
            + (layer_kv // 2) * src_stride_layer
            + (layer_kv % 2) * src_stride_kv
            + tokens[:, None] * src_stride_token
        )
        dst_rows = (
            DST + block * dst_stride_block + (layer_kv * BLOCK_SIZE + slots[:, None]).to(tl.int64) * row_width
        )
        for start in range(0, row_width, COLS):
            cols = start + tl.arange(0, COLS)
            in_row = cols < row_width
            # Through fp32: the clamp and the rounding then match a cast from any source dtype.
            values = tl.load(src_rows + cols[None, :], mask=live[:, None] & in_row[None, :], other=0.0).to(
                tl.float32
            )
            if LIMIT > 0:
                values = tl.minimum(tl.maximum(values, -LIMIT), LIMIT)
            tl.store(
                dst_rows + cols[None, :],
                values.to(DST.dtype.element_ty),
                mask=in_block[:, None] & in_row[None, :],
            )


_JITTED: dict[str, object] = {}


def triton_write_sequence(cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor) -> None:
    """Same contract as ``PagedKVStorage.write_sequence`` on its ``cache`` [num_blocks, layers, 2,
    block_size, H, D] (contiguous): ``kv`` [layers, 2, seq_len, H, D] on the cache's device, each
    token's H x D elements contiguous (e.g. a view of the cross-K/V projection's product)."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_write_sequence_kernel)
    layers, _, block_size, heads, head_dim = cache.shape[1:]
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    if kv.stride(4) != 1 or kv.stride(3) != head_dim:
        raise ValueError("each token's K/V (H x D) must be contiguous")
    seq_len = kv.shape[2]
    if kv.shape[:2] != (layers, 2) or kv.shape[3:] != (heads, head_dim):
        raise ValueError(f"K/V of shape {tuple(kv.shape)} does not fit a cache of shape {tuple(cache.shape)}")
    limit = (
        torch.finfo(cache.dtype).max if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point else 0.0
    )
    rows = min(16, triton.next_power_of_2(block_size))
    ids = torch.tensor(block_ids, dtype=torch.int32).to(cache.device, non_blocking=True)
    _JITTED["kernel"][(len(block_ids), layers * 2, ceil_div(block_size, rows))](
        kv,
        cache,
        ids,
        seq_len,
        heads * head_dim,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        cache.stride(0),
        LIMIT=float(limit),
        BLOCK_SIZE=block_size,
        ROWS=rows,
        COLS=256,
        num_warps=4,
    )
