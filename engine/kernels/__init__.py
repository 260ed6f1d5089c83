"""Triton kernels other than attention's (timestamp rules, fused residual norms, block writes), and
the one place that says whether Triton is here.

Triton is optional: absent on CPU-only installs, where every kernel has a PyTorch counterpart.
Kernels are JIT-decorated on first use, so ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, read
when a function is decorated) need only be set before the first call.
"""

from __future__ import annotations

import os

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
