"""FP8 (e4m3) matrix products for the encoder, where the GPU has FP8 tensor cores.

The encoder is fixed-size compute (a 30 s window is 1500 frames through every layer) and, for
large-v3-turbo, what bounds a GPU's throughput; its products are most of its time, and FP8
tensor cores (compute capability 8.9 and up: Ada, Hopper) multiply at twice the 16-bit rate.

Scales, as FP8 inference commonly does it:
* weights: one scale per output channel, set once when the model loads (the largest magnitude of
  the channel maps to e4m3's largest value, 448);
* activations: one scale per token (per frame), computed at every call from the token's largest
  magnitude. A per-token scale keeps one loud frame from flattening its quiet neighbours.
The product leaves in 16 bits with both scales applied (torch's ``_scaled_mm`` with row-wise
scales), biases added in the same call. It accumulates in the tensor cores' own accumulator
without promoting partial sums to fp32 along the way (``use_fast_accum``): on Hopper that makes
the encoder faster, and the accumulator's rounding is far below that of inputs with 3 mantissa
bits.

Layer norms, softmax, GELU and the attention itself stay in 16 bits; compiled (the encoder's
``torch.compile``), each activation's quantization fuses into the pass that produced it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.model.submodules import replace_submodules

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
# A channel or token of zeros would divide by zero; any scale decodes zeros to zeros.
_SMALLEST_SCALE = 1e-12


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies in FP8: a CUDA GPU of compute capability 8.9 or up. (CPUs run
    ``_scaled_mm`` too, slowly, which is what lets the tests check this module's arithmetic.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, k] -> (e4m3 values, fp32 scale per row [rows, 1]) with x ~= values * scale."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_SMALLEST_SCALE) / E4M3_MAX
    return (x.float() / scale).to(E4M3), scale


@functools.lru_cache(maxsize=None)
def _product_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype ``_scaled_mm`` gives row-wise scaled products in on ``device``: ``dtype``
    where the kernel has it, else bf16 (cast after; some builds give row-wise scales bf16 only)."""
    ones = torch.ones(16, 16, device=device).to(E4M3)
    scale_a, scale_b = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    try:
        torch._scaled_mm(
            ones,
            ones.t(),
            scale_a=scale_a,
            scale_b=scale_b,
            bias=torch.zeros(16, device=device, dtype=dtype),
            out_dtype=dtype,
        )
        return dtype
    except RuntimeError:
        return torch.bfloat16


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose product runs in e4m3 with per-channel weight and per-token activation
    scales; input and output in the model's 16-bit dtype (output: see ``leave_in``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        values, scale = quantize_rows(weight)
        # _scaled_mm takes the second operand column-major: keep the [out, in] weight and pass .t().
        self.register_buffer("weight_values", values)
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.product_dtype = _product_dtype(weight.device, self.dtype)
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias.to(weight.device, self.product_dtype))

    def leave_in(self, dtype: torch.dtype) -> None:
        """Give the product in ``dtype`` (16-bit) from now on, straight from ``_scaled_mm``: for a
        consumer that wants another 16-bit dtype than the model's, without a cast after."""
        self.dtype = dtype
        self.product_dtype = _product_dtype(self.bias.device, dtype)
        self.bias = self.bias.to(self.product_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return self.product(values, scale).view(*x.shape[:-1], self.out_features)

    def product(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The product of rows already quantized (e4m3 values [rows, in], fp32 scales [rows, 1])
        -> [rows, out] in the output's dtype."""
        out = torch._scaled_mm(
            values,
            self.weight_values.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=self.product_dtype,
            use_fast_accum=True,
        )
        return out.to(self.dtype)


def quantize_linears(module: nn.Module, names: list[str]) -> int:
    """Replace the ``nn.Linear`` children of ``module`` named in ``names`` (dotted paths) by
    Fp8Linear, freeing their 16-bit weights; returns how many were replaced."""
    return replace_submodules(module, names, Fp8Linear)
