"""A residual add and the layer norm after it as one Triton kernel (the decoder's hot path).

A large-v3 decode step has 97 (add, layer norm) pairs. As separate PyTorch kernels (an
elementwise add, then a layer-norm block per row) each pair writes the sum to memory and reads it
back, and launches two kernels: a noticeable share of a decode step (measured:
benchmarks/RESULTS.md). Fused, the sum is written once and normalised from registers.

Numerics follow eager PyTorch: the sum is rounded to the input dtype (as ``x + delta`` is) before
it is normalised, and the statistics are fp32. The kernel is captured in the decode CUDA graphs
like any other. JIT-decorated on first use, like the attention kernels, so Triton's CPU
interpreter (``TRITON_INTERPRET=1``) can run it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

if triton_available():

    def _add_layer_norm_kernel(
        X,
        DELTA,
        WEIGHT,
        BIAS,
        SUM_OUT,
        NORM_OUT,
        stride_x,
        stride_delta,
        stride_sum,
        stride_norm,
        n_cols,
        eps,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0)
        delta = tl.load(DELTA + row * stride_delta + cols, mask=valid, other=0.0)
        total = (x + delta).to(SUM_OUT.dtype.element_ty)
        tl.store(SUM_OUT + row * stride_sum + cols, total, mask=valid)
        total = total.to(tl.float32)
        mean = tl.sum(total, axis=0) / n_cols
        centred = tl.where(valid, total - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        weight = tl.load(WEIGHT + cols, mask=valid, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + cols, mask=valid, other=0.0).to(tl.float32)
        tl.store(
            NORM_OUT + row * stride_norm + cols,
            (centred * rstd * weight + bias).to(NORM_OUT.dtype.element_ty),
            mask=valid,
        )


_JITTED: dict[str, object] = {}


def triton_add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``engine.model.whisper.add_layer_norm``: (x + delta, layer_norm(x + delta)), x and
    delta [T, d] with a contiguous last dimension."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_add_layer_norm_kernel)
    if x.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError("add_layer_norm needs rows with a contiguous last dimension")
    rows, cols = x.shape
    total = torch.empty_like(x)
    normed = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(cols)
        _JITTED["kernel"][(rows,)](
            x,
            delta,
            weight,
            bias,
            total,
            normed,
            x.stride(0),
            delta.stride(0),
            total.stride(0),
            normed.stride(0),
            cols,
            eps,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return total, normed
