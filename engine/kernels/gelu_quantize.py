"""The FP8 encoder's MLP middle in one Triton kernel: GELU of fc1's output, each row's largest
magnitude, and the row quantized to e4m3 for fc2 (engine/model/fp8.py).

Compiled as separate operations, torch.compile makes this a looped reduction over the 5120-wide
rows of large-v3: it reads every row twice and computes the GELU twice, and took about as long
as the FP8 products saved (profile: benchmarks/RESULTS.md). Here one program holds one row in
registers: read once, GELU once, amax, scale, write the e4m3 row and its scale.

Numerics follow ``engine.model.fp8.quantize_rows`` of ``F.gelu`` (exact, erf form) in fp32:
the same scale, and the same round-to-nearest-even cast to e4m3. JIT-decorated on first use, so
Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

E4M3_MAX = 448.0
_SMALLEST_SCALE = 1e-12

if triton_available():

    def _gelu_quantize_rows_kernel(X, VALUES, SCALES, stride_x, stride_values, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
        gelu = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        # Literals, not _SMALLEST_SCALE and E4M3_MAX: a jitted kernel may read only constexpr globals.
        scale = tl.maximum(tl.max(tl.abs(gelu), axis=0), 1e-12) / 448.0
        tl.store(VALUES + row * stride_values + cols, (gelu / scale).to(VALUES.dtype.element_ty), mask=valid)
        tl.store(SCALES + row, scale)


_JITTED: dict[str, object] = {}


def gelu_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (16-bit, contiguous rows) -> (e4m3 values of GELU(x) [rows, cols], fp32
    scale per row [rows, 1]), as ``quantize_rows(F.gelu(x.float()))``."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_gelu_quantize_rows_kernel)
    if x.stride(-1) != 1:
        raise ValueError("gelu_quantize_rows needs rows with a contiguous last dimension")
    rows, cols = x.shape
    values = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _JITTED["kernel"][(rows,)](
            x,
            values,
            scales,
            x.stride(0),
            values.stride(0),
            cols,
            BLOCK=block,
            num_warps=8 if block > 2048 else 4,
        )
    return values, scales


@torch.library.custom_op("whisper_disagg::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gelu_quantize_rows`` as an operator torch.compile keeps whole (it does not trace into
    the launch)."""
    return gelu_quantize_rows(x)


@gelu_quantize_rows_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)
