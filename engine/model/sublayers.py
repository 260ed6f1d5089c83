"""How a decoder layer's sublayers run: the residual adds with the layer norms after them, the
matrix products, and the self-attention K/V write. Two ways, one contract:

- ``Sublayers``: each product is ``product`` (a dense ``nn.Linear`` call), each residual add and
  the norm after it ``add_norm`` (PyTorch's two operations, or one fused Triton kernel,
  engine/kernels/fused_norm.py), and the keys and values go into the cache in one indexed write.
- ``SmallRowsSublayers``: at a decode step's few rows on a GPU, each product is one kernel
  (engine/kernels/small_products.py), and the QKV product's kernel stores the keys and values into
  their cache slots itself; at one row the residual add and layer norm before a product are folded
  into its kernel too. Whatever the kernel does not take goes the first way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.small_products import (
    FoldedNorm,
    KVSlots,
    folds_norm,
    stores_kv,
    supports,
    triton_add_norm_linear,
    triton_small_rows_linear,
)
from engine.kv.storage import to_cache_dtype


def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``x + delta``, and that sum layer-normed (the next sublayer's input).
    ``Sublayers.add_norm`` by default; ``TextDecoder.fuse_residual_norms`` swaps in one Triton
    kernel with the same contract (engine/kernels/fused_norm.py)."""
    x = x + delta
    return x, F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def dense_product(x: torch.Tensor, linear: nn.Linear, gelu: bool = False) -> torch.Tensor:
    """``linear(x)``, then the exact GELU where asked."""
    out = linear(x)
    return F.gelu(out) if gelu else out


def norm_params(norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
    return norm.weight, norm.bias, norm.eps


def _queries_after_writing_kv(projected: torch.Tensor, slots: KVSlots) -> torch.Tensor:
    """The queries [T, d] of a QKV product [T, 3 * d], its keys and values written to the tokens'
    ``slots`` in one indexed write (one kernel, not two)."""
    projected = projected.view(projected.shape[0], 3, *slots.cache.shape[-2:])
    slots.cache[slots.block_ids, :, slots.offsets] = to_cache_dtype(projected[:, 1:], slots.cache.dtype)
    return projected[:, 0].flatten(1)


def _add_norm_then_product(
    sublayers: Sublayers | SmallRowsSublayers,
    x: torch.Tensor,
    delta: torch.Tensor,
    norm: nn.LayerNorm,
    linear: nn.Linear,
    gelu: bool,
    slots: KVSlots | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_norm_product`` as two steps: ``sublayers``' add and norm, then its product."""
    x, h = sublayers.add_norm(x, delta, *norm_params(norm))
    if slots is None:
        return x, sublayers.product(h, linear, gelu)
    return x, sublayers.queries_writing_kv(h, linear, slots)


@dataclass(frozen=True)
class Sublayers:
    """The dense way: ``product`` for each product (``dense_product``, or a test's stand-in), and
    ``add_norm`` for each residual add and the layer norm after it."""

    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_layer_norm
    product: Callable[..., torch.Tensor] = dense_product

    def queries_writing_kv(self, h: torch.Tensor, qkv: nn.Linear, slots: KVSlots) -> torch.Tensor:
        """The queries [T, d] of ``qkv``'s product of ``h``, whose keys and values go to the tokens'
        ``slots`` in the cache."""
        return _queries_after_writing_kv(self.product(h, qkv), slots)

    def add_norm_product(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        norm: nn.LayerNorm,
        linear: nn.Linear,
        gelu: bool = False,
        slots: KVSlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``x + delta``, and ``linear``'s product of its layer norm (``norm``'s),
        then the GELU where asked; with ``slots`` (a QKV product) the queries, as ``queries_writing_kv``."""
        return _add_norm_then_product(self, x, delta, norm, linear, gelu, slots)


@dataclass(frozen=True)
class SmallRowsSublayers:
    """``Sublayers``' contract with the products through the small-rows kernel wherever it takes one
    (``engine.kernels.small_products.supports``), else ``otherwise``'s. A product in ``folded`` takes
    the residual add and layer norm before it into its kernel where ``folds_norm``."""

    otherwise: Sublayers
    folded: Mapping[nn.Linear, FoldedNorm] = field(default_factory=dict)

    @property
    def add_norm(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return self.otherwise.add_norm

    def product(self, x: torch.Tensor, linear: nn.Linear, gelu: bool = False) -> torch.Tensor:
        if not supports(x, linear.weight):
            return self.otherwise.product(x, linear, gelu)
        return triton_small_rows_linear(x, linear.weight, linear.bias, gelu)

    def queries_writing_kv(self, h: torch.Tensor, qkv: nn.Linear, slots: KVSlots) -> torch.Tensor:
        if not (supports(h, qkv.weight) and stores_kv(h, slots)):
            return _queries_after_writing_kv(self.product(h, qkv), slots)
        return triton_small_rows_linear(h, qkv.weight, qkv.bias, slots=slots)

    def add_norm_product(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        norm: nn.LayerNorm,
        linear: nn.Linear,
        gelu: bool = False,
        slots: KVSlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        folded = self.folded.get(linear)
        if (
            folded is not None
            and folds_norm(x, delta, linear.weight)
            and (slots is None or stores_kv(x, slots))
        ):
            return triton_add_norm_linear(x, delta, folded, linear.weight, gelu, slots)
        return _add_norm_then_product(self, x, delta, norm, linear, gelu, slots)
