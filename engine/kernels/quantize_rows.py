"""Rows quantized to e4m3 for the FP8 encoder's next product (engine/model/fp8.py), one Triton
kernel each: fc1's output through GELU for fc2 (the MLP's middle), and attention's output for its
projection.

Compiled as separate operations, torch.compile makes each a looped reduction: it read every row
twice (and for the MLP computed the GELU twice), and the MLP's took about as long as the FP8
products saved. Here one program holds one row in registers:
read once, GELU once, amax, scale, write the e4m3 row and its scale.

Numerics follow ``engine.model.fp8.quantize_rows`` of ``F.gelu(approximate="tanh")`` in fp32 (the
16-bit encoder's fused epilogue takes the tanh form too: engine/model/whisper.py): the same scale,
and the same round-to-nearest-even cast to e4m3 (of the GELU times the scale's reciprocal, which
may differ from the quotient by an ulp before the cast). With erf's exact form the kernel is
bound by its arithmetic; in the tanh form it moves its bytes at the memory's rate.
JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

if triton_available():

    def _quantize_rows_kernel(
        X,
        VALUES,
        SCALES,
        stride_x,
        stride_values,
        n_cols,
        HEAD: tl.constexpr,
        TAIL: tl.constexpr,
        GELU: tl.constexpr,
    ):
        # A row as two power-of-two pieces, HEAD columns and up to TAIL more (5120 = 4096 + 1024),
        # rather than one piece padded to the next power of two, whose padded lanes would compute
        # as much as real ones.
        row = tl.program_id(0).to(tl.int64)
        head_cols = tl.arange(0, HEAD)
        tail_cols = HEAD + tl.arange(0, TAIL)
        in_tail = tail_cols < n_cols
        head = tl.load(X + row * stride_x + head_cols).to(tl.float32)
        tail = tl.load(X + row * stride_x + tail_cols, mask=in_tail, other=0.0).to(tl.float32)
        # GELU's tanh form, 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): one exponential an element,
        # where erf's polynomial made the kernel arithmetic-bound.
        if GELU:
            head = head / (1.0 + tl.exp(-1.5957691216057308 * (head + 0.044715 * head * head * head)))
            tail = tail / (1.0 + tl.exp(-1.5957691216057308 * (tail + 0.044715 * tail * tail * tail)))
        largest = tl.maximum(tl.max(tl.abs(head), axis=0), tl.max(tl.abs(tail), axis=0))
        # Literals: a jitted kernel may read only constexpr globals (engine/model/fp8.py's smallest
        # scale and e4m3's largest value).
        scale = tl.maximum(largest, 1e-12) / 448.0
        inverse = 1.0 / scale  # one division a row; a product per element
        dtype = VALUES.dtype.element_ty
        tl.store(VALUES + row * stride_values + head_cols, (head * inverse).to(dtype))
        tl.store(VALUES + row * stride_values + tail_cols, (tail * inverse).to(dtype), mask=in_tail)
        tl.store(SCALES + row, scale)


_JITTED: dict[str, object] = {}


def triton_quantize_rows(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (16-bit, contiguous rows) -> (e4m3 values [rows, cols], fp32 scale per row
    [rows, 1]), as ``engine.model.fp8.quantize_rows(x.float())``, or with ``gelu`` of
    ``F.gelu(x.float(), approximate="tanh")``."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_quantize_rows_kernel)
    if x.stride(-1) != 1:
        raise ValueError("triton_quantize_rows needs rows with a contiguous last dimension")
    rows, cols = x.shape
    values = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        head = triton.next_power_of_2(cols + 1) // 2  # the largest power of two up to cols
        _JITTED["kernel"][(rows,)](
            x,
            values,
            scales,
            x.stride(0),
            values.stride(0),
            cols,
            HEAD=head,
            TAIL=max(1, triton.next_power_of_2(cols - head)),
            GELU=gelu,
            num_warps=4,
        )
    return values, scales


def _rows_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


# As operators torch.compile keeps whole (it does not trace into the launch).
@torch.library.custom_op("whisper_disagg::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_quantize_rows(x, gelu=True)


@torch.library.custom_op("whisper_disagg::quantize_rows", mutates_args=())
def quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_quantize_rows(x, gelu=False)


gelu_quantize_rows_op.register_fake(_rows_like)
quantize_rows_op.register_fake(_rows_like)
