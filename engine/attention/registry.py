"""Choosing an attention backend by name: "auto" | "torch" | "triton" | "flash_attn"."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.kernels import TRITON_IMPORT_ERROR, triton_available, triton_interpreting

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


def kv_cache_dtype_problem(name: str, cache_dtype: torch.dtype) -> str | None:
    """Why backend ``name`` can never read a KV cache of ``cache_dtype`` (whatever the device), or
    None. Checked by EngineConfig at start-up, and by the registry where "auto" chooses."""
    if name == "flash_attn" and cache_dtype == torch.float8_e4m3fn:
        return (
            "flash-attn's paged kernels cannot read an fp8 KV cache; use attention_backend triton "
            "(or torch), or kv_cache_dtype auto"
        )
    return None


def _triton_problem(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why the triton backend cannot run on ``device`` (with a KV cache of ``dtype``), or None when it can."""
    if not triton_available():
        return f"the 'triton' package is not importable ({TRITON_IMPORT_ERROR})"
    if device.type != "cuda" and not triton_interpreting():
        return (
            f"triton kernels need a CUDA device, got {device} "
            "(TRITON_INTERPRET=1 runs them on CPU, for tests)"
        )
    if (
        device.type == "cuda"
        and dtype == torch.float8_e4m3fn
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        # Triton refuses the e4m3 type below sm_89 ("fp8e4nv data type is not supported on CUDA arch < 89").
        return (
            f"Triton reads an fp8 (e4m3) KV cache only on compute capability 8.9+ (Ada, Hopper), this GPU is "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; use kv_cache_dtype auto"
        )
    return None


def _flash_attn_problem(
    device: torch.device, block_size: int | None, dtype: torch.dtype | None
) -> str | None:
    """Why the flash_attn backend cannot run here, or None when it can."""
    from engine.attention import flash_attn_backend as fa

    if not fa.flash_attn_available():
        return f"the 'flash-attn' package is not importable ({fa.flash_attn_import_error()})"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device}"
    dtype_problem = kv_cache_dtype_problem("flash_attn", dtype) if dtype is not None else None
    if dtype_problem:
        return dtype_problem
    if block_size is not None and block_size % fa.FLASH_ATTN_PAGE_MULTIPLE != 0:
        return (
            f"flash-attn's paged KV needs block_size a multiple of {fa.FLASH_ATTN_PAGE_MULTIPLE}, "
            f"got {block_size}"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports float16/bfloat16 only, got {dtype}"
    return None


def make_attention_backend(
    name: str,
    device: torch.device,
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Build the named backend for ``device``.

    "auto" picks flash_attn if it imports and the device is CUDA, else triton if it imports and
    the device is CUDA, else torch: on a CPU the torch reference with cross-attention read in place
    (engine/attention/cpu_in_place.py), elsewhere the reference itself. ``block_size`` and
    ``dtype`` (optional, the KV cache's) let "auto" skip flash_attn where flash-attn would refuse
    them (block sizes that are not a multiple of 256, float32, fp8), and let an explicit
    "flash_attn" (or "triton" with an fp8 cache on a GPU older than sm_89) fail at construction
    rather than at the first step. Asking explicitly for a backend that cannot run raises
    ValueError saying what is missing.
    """
    device = torch.device(device)
    if name == "torch":
        if device.type == "cpu":
            from engine.attention.cpu_in_place import CpuInPlaceBackend

            return CpuInPlaceBackend()
        from engine.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "triton":
        problem = _triton_problem(device, dtype)
        if problem:
            raise ValueError(f"attention backend 'triton' is unavailable: {problem}")
        from engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    if name == "flash_attn":
        problem = _flash_attn_problem(device, block_size, dtype)
        if problem:
            raise ValueError(f"attention backend 'flash_attn' is unavailable: {problem}")
        from engine.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(block_size=block_size)
    if name == "auto":
        if device.type == "cuda":
            flash_problem = _flash_attn_problem(device, block_size, dtype)
            if flash_problem is None:
                return make_attention_backend("flash_attn", device, block_size=block_size, dtype=dtype)
            triton_problem = _triton_problem(device, dtype)
            if triton_problem is None:
                logger.info("attention backend auto -> triton (flash_attn: %s)", flash_problem)
                return make_attention_backend("triton", device, dtype=dtype)
            logger.info(
                "attention backend auto -> torch (flash_attn: %s; triton: %s)", flash_problem, triton_problem
            )
        return make_attention_backend("torch", device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
