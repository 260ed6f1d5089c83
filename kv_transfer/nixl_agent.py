"""NIXL's Python API, the agents the connector makes, and NIXL's names for where memory lives."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def nixl_api() -> ModuleType:
    """NIXL's Python API: from the `nixl` meta package when installed (it picks the build matching
    torch's CUDA), else straight from the one variant that is (the project requires nixl-cu13)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL build is importable: `pip install nixl-cu13` (nixl-cu12 for a CUDA 12 torch)")


def make_agent(name: str, device: torch.device, progress_thread: bool = False):
    """An agent over UCX. ``progress_thread``: NIXL's own thread makes the agent's progress (native
    code, so it never waits for Python's GIL; it busy-polls a core). Without it, our own calls into
    the agent drive progress: the receiver's while it waits on a READ, the sender's service polls."""
    api = nixl_api()
    if device.type == "cuda":
        torch.zeros(1, device=device)  # a live CUDA context first, so UCX offers its CUDA transports
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def memory_kind(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)
