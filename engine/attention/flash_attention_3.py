"""FlashAttention-3 for the encoder's dense self-attention, on Hopper GPUs where a build is installed.

Why: at the encoder's shape (heads of 64, 1500 frames, no mask) torch's SDPA runs cuDNN's fused
kernel, bound by its exponentials and by how well it overlaps them with its products.
FlashAttention-3 overlaps the softmax of one warp group with the tensor cores of another, and on
Hopper runs the same attention faster at an encoder's batches.

It is no dependency of the project: any build exposing FlashAttention-3's interface serves. Two
module names are looked for, in order: ``flash_attn_interface`` (flash-attention's own hopper/
build, and the registry's ``tokenspeed-fa3`` wheel) and ``fa3_fwd_interface`` (the registry's
``fa3-fwd``, forward-only and without fp16 kernels). Each build's config module says which dtypes
and head sizes it was compiled with.

The encoder calls the build's registered operator rather than its autograd wrapper, so
torch.compile and the encoder's CUDA graphs see one opaque operation a layer.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# (interface module, config module, operator namespace), in the order they are tried.
_BUILDS = (
    ("flash_attn_interface", "flash_attn_config", "flash_attn_3"),
    ("fa3_fwd_interface", "fa3_fwd_config", "fa3_fwd"),
)
_DTYPE_FLAGS = {torch.float16: "FLASHATTENTION_DISABLE_FP16", torch.bfloat16: None}
_HEAD_DIMS = (64, 96, 128, 192, 256)

# Fewer windows than this take SDPA even where FlashAttention-3 serves: at one or two windows of
# 20 heads its kernel is slower than cuDNN's, from three on faster.
MIN_WINDOWS = 3

INSTALL_HINT = (
    "install a FlashAttention-3 build for this torch and CUDA (pip install tokenspeed-fa3 for CUDA 13, "
    "or build flash-attention's hopper/ folder)"
)


@dataclass(frozen=True)
class FlashAttention3:
    """An installed FlashAttention-3 build: its forward operator and what it was compiled for."""

    module: str
    forward: Callable[..., tuple[torch.Tensor, ...]]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, frames, heads, head_dim], strided views with the last dim contiguous (as
        the packed QKV product's) -> [N, frames, heads, head_dim], contiguous; no mask."""
        return self.forward(q, k, v, causal=False)[0]


@functools.cache
def installed_flash_attention_3() -> FlashAttention3 | None:
    """The first FlashAttention-3 build that imports, or None."""
    for interface, config, namespace in _BUILDS:
        try:
            importlib.import_module(interface)  # registers the build's operators with torch
            flags = importlib.import_module(config).CONFIG["build_flags"]
            forward = getattr(torch.ops, namespace)._flash_attn_forward
        except (ImportError, OSError, AttributeError, KeyError, RuntimeError):
            continue  # not installed, or built for another torch or CUDA
        return FlashAttention3(interface, forward, *build_capabilities(flags))
    return None


def build_capabilities(flags: dict[str, bool]) -> tuple[frozenset[torch.dtype], frozenset[int]]:
    """The 16-bit dtypes and head sizes a build has kernels for, from its config's build flags."""
    dtypes = frozenset(d for d, flag in _DTYPE_FLAGS.items() if not (flag and flags.get(flag)))
    head_dims = frozenset(d for d in _HEAD_DIMS if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}"))
    return dtypes, head_dims


def flash_attention_3_problem(device: torch.device, head_dim: int) -> str | None:
    """Why FlashAttention-3 cannot run the encoder's attention on ``device``, or None."""
    if device.type != "cuda":
        return f"FlashAttention-3 runs on CUDA GPUs, and the engine's device is {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (
            "FlashAttention-3 runs on Hopper GPUs (compute capability 9.0), and this GPU is "
            f"{capability[0]}.{capability[1]}"
        )
    build = installed_flash_attention_3()
    if build is None:
        return f"no FlashAttention-3 build is installed: {INSTALL_HINT}"
    if head_dim not in build.head_dims:
        return f"the installed FlashAttention-3 build ({build.module}) has no kernels for heads of {head_dim}"
    return None


def attention_dtype(
    build: FlashAttention3, model_dtype: torch.dtype, fp8_products: bool
) -> torch.dtype | None:
    """The dtype the encoder's attention runs in through ``build``, or None where it cannot.

    With FP8 products the QKV product can leave in either 16-bit dtype at no cost, and bf16 is
    preferred where the build has it: its kernel is the faster of the two, and its coarser
    rounding of Q, K and V is ten times finer than the e4m3 rounding of attention's output that
    follows. Otherwise attention runs in the model's dtype or not at all:
    a cast would add a pass over the QKV product."""
    if fp8_products:
        for dtype in (torch.bfloat16, torch.float16):
            if dtype in build.dtypes:
                return dtype
        return None
    return model_dtype if model_dtype in build.dtypes else None
