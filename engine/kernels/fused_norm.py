"""A residual add and the layer norm after it as one Triton kernel, optionally quantizing the
normed row to e4m3 for an FP8 product.

A large-v3 decode step has 97 (add, layer norm) pairs. As separate PyTorch kernels (an elementwise
add, then a layer-norm block per row) each pair writes the sum to memory and reads it back, and
launches two kernels: a noticeable share of a decode step. Fused, the sum is written once and
normalised from registers.

The FP8 encoder (engine/model/fp8.py) feeds its QKV and fc1 products layer-normed rows quantized per
row. Compiled, torch.compile made each (add, layer norm, row amax, quantize) a looped reduction that
read the row several times, well below the memory's rate; here the row is read once, and leaves as
e4m3 values and a scale.

Numerics follow eager PyTorch: the sum is rounded to the input dtype (as ``x + delta`` is) before
it is normalised, the statistics are fp32, and a quantized row is the layer norm's 16-bit output
quantized as ``engine.model.fp8.quantize_rows`` does (times the scale's reciprocal). The kernel is
captured in the decode CUDA graphs like any other. JIT-decorated on first use, like the attention
kernels, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) can run it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import early_launch, launch_control, tl, triton, triton_available

if triton_available():
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    def _add_layer_norm_kernel(
        X,
        DELTA,
        WEIGHT,
        BIAS,
        SUM_OUT,
        NORM_OUT,
        SCALES,
        stride_x,
        stride_delta,
        stride_sum,
        stride_norm,
        n_cols,
        eps,
        BLOCK: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        QUANTIZE: tl.constexpr,
        LAUNCH_CONTROL: tl.constexpr,
    ):
        if LAUNCH_CONTROL:
            # The next kernel may start now: a product (engine/kernels/small_products.py) loads its
            # weights meanwhile, and waits for this kernel's end before it reads the normed rows.
            # This one was launched early in turn: it waits for the kernel before it to end.
            gdc_launch_dependents()
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0)
        if HAS_DELTA:
            delta = tl.load(DELTA + row * stride_delta + cols, mask=valid, other=0.0)
            total = (x + delta).to(SUM_OUT.dtype.element_ty)
            tl.store(SUM_OUT + row * stride_sum + cols, total, mask=valid)
        else:
            total = x
        total = total.to(tl.float32)
        mean = tl.sum(total, axis=0) / n_cols
        centred = tl.where(valid, total - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        weight = tl.load(WEIGHT + cols, mask=valid, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + cols, mask=valid, other=0.0).to(tl.float32)
        normed = centred * rstd * weight + bias
        if QUANTIZE:
            normed = normed.to(X.dtype.element_ty).to(tl.float32)  # the 16-bit layer norm's output
            largest = tl.max(tl.where(valid, tl.abs(normed), 0.0), axis=0)
            # Literals: a jitted kernel may read only constexpr globals (engine/model/fp8.py's
            # smallest scale and e4m3's largest value).
            scale = tl.maximum(largest, 1e-12) / 448.0
            quantized = (normed * (1.0 / scale)).to(NORM_OUT.dtype.element_ty)
            tl.store(NORM_OUT + row * stride_norm + cols, quantized, mask=valid)
            tl.store(SCALES + row, scale)
        else:
            tl.store(NORM_OUT + row * stride_norm + cols, normed.to(NORM_OUT.dtype.element_ty), mask=valid)


_JITTED: dict[str, object] = {}


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    normed: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """Run the kernel over the rows of ``x`` [T, d]; returns the sum (``x`` itself without a delta)."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_add_layer_norm_kernel)
    # Rows need a contiguous last dimension; a compiled graph may hand over another layout.
    x = x if x.stride(-1) == 1 else x.contiguous()
    delta = delta if delta is None or delta.stride(-1) == 1 else delta.contiguous()
    rows, cols = x.shape
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else x
    if rows:
        block = triton.next_power_of_2(cols)
        control = launch_control(x.device)
        _JITTED["kernel"][(rows,)](
            x,
            delta if delta is not None else x,
            weight,
            bias,
            total,
            normed,
            scales if scales is not None else normed,
            x.stride(0),
            delta.stride(0) if delta is not None else 0,
            total.stride(0),
            normed.stride(0),
            cols,
            eps,
            BLOCK=block,
            HAS_DELTA=delta is not None,
            QUANTIZE=scales is not None,
            LAUNCH_CONTROL=control,
            num_warps=4 if block <= 2048 else 8,
            **early_launch(control),
        )
    return total


def triton_add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``engine.model.sublayers.add_layer_norm``: (x + delta, layer_norm(x + delta)),
    x and delta [T, d]."""
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, delta, weight, bias, eps, normed, None), normed


def _quantized_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    return values, torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)


@torch.library.custom_op("whisper_disagg::layer_norm_quantize_rows", mutates_args=())
def layer_norm_quantize_rows_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_norm(x) [T, d] (16-bit, contiguous rows) quantized per row -> (e4m3 values [T, d], fp32
    scales [T, 1]), as ``quantize_rows(F.layer_norm(x, ...))``; an operator torch.compile keeps whole."""
    values, scales = _quantized_outputs(x)
    _launch(x, None, weight, bias, eps, values, scales)
    return values, scales


@layer_norm_quantize_rows_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantized_outputs(x)


@torch.library.custom_op("whisper_disagg::add_layer_norm_quantize_rows", mutates_args=())
def add_layer_norm_quantize_rows_op(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, and layer_norm(x + delta) quantized per row as ``layer_norm_quantize_rows_op``)."""
    values, scales = _quantized_outputs(x)
    total = _launch(x, delta, weight, bias, eps, values, scales)
    return total, values, scales


@add_layer_norm_quantize_rows_op.register_fake
def _(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), *_quantized_outputs(x)
