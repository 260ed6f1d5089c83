"""Triton kernels other than attention's (timestamp rules, fused residual norms, block writes), the
one place that says whether Triton is here, and how many SMs a GPU has (launch sizes and SM shares).

Triton is optional: absent on CPU-only installs, where every kernel has a PyTorch counterpart.
Kernels are JIT-decorated on first use, so ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, read
when a function is decorated) need only be set before the first call.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - exercised only where triton is missing or broken
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = repr(exc)  # the text only (no frames kept)


def triton_available() -> bool:
    """True when the triton package imports (kernels still need CUDA or TRITON_INTERPRET=1)."""
    return triton is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def launch_control(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (Triton's ``launch_pdl``, and
    ``gdc_wait`` / ``gdc_launch_dependents`` inside): CUDA on Hopper (compute capability 9.0) and
    later; not Triton's interpreter, which lacks them."""
    return device.type == "cuda" and not triton_interpreting() and _cuda_properties(device).major >= 9


def early_launch(control: bool) -> dict[str, bool]:
    """Triton launch options that let a kernel start before the one ahead of it has ended, where
    ``control`` (``launch_control``); the kernel then calls ``gdc_wait`` before it reads that one's output."""
    return {"launch_pdl": True} if control else {}


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (1 elsewhere), read once per device."""
    return _cuda_properties(device).multi_processor_count if device.type == "cuda" else 1


def _cuda_properties(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _properties_of(index)


@functools.cache
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)
