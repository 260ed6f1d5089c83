"""The encoder's matrix products on a CPU's bf16 instructions around a float32 residual stream
(engine.cpu_dtype 'bfloat16-products').

A CPU with AVX-512 BF16 multiplies bf16 matrices at more than twice its float32 rate, and the
encoder is almost all matrix products. Run wholly in bf16 (cpu_dtype 'bfloat16'), the encoder also
rounds what it carries from layer to layer (the residual stream, the norms' inputs) and its
attention scores to bf16; those roundings accumulate and change transcripts on speech the model is
unsure of. Here only the products' operands are bf16: each layer's four linear products take bf16
weights and a bf16 copy of their input, attention's scores are a float32 product (its second
product takes bf16 probabilities), and the convolutions, layer norms, residual adds and softmax run
in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.submodules import replace_submodules

# Each encoder layer's products, as paths under the layer.
ENCODER_LAYER_PRODUCTS = ("qkv", "attn_out", "mlp.fc1", "mlp.fc2")


class Bf16ProductLinear(nn.Module):
    """A linear product in bf16: weight and bias held in bf16, the input rounded to bf16 on the way
    in, the output left in bf16 (the float32 residual add after it widens it back)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias)


def products_in_bf16(
    layer: nn.Module,
    products: tuple[str, ...] = ENCODER_LAYER_PRODUCTS,
    scores_dtype: torch.dtype | None = torch.float32,
) -> None:
    """An encoder layer's products named in ``products`` replaced by Bf16ProductLinear, and its
    attention computed by products (engine/model/cpu_attention.py): P V with bf16 operands, the
    scores a ``scores_dtype`` product (None: bf16, as their operands)."""
    replace_submodules(layer, products, Bf16ProductLinear)
    layer.attention_by_products = True
    layer.attention_scores_dtype = scores_dtype
