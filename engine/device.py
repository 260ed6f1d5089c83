"""Copies between host and device that never make the host wait for the GPU.

A plain ``tensor.to("cuda")`` from ordinary host memory, or ``.tolist()`` of a device tensor,
waits for everything queued on the stream. The decode loop launches step N+1 before it reads
step N's tokens (engine/decode/step/pipeline.py), so a single such copy in the step would put the GPU's whole
queue back on the host's critical path. These go through pinned memory instead: PyTorch's caching
host allocator keeps a pinned buffer from reuse until the copy that reads it has run, so the
source may be dropped at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(values: Sequence[int] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the device."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PendingDownload:
    """Device tensors on their way to the host; ``wait(i)`` returns the i-th once the copies have
    landed. One event marks them all (an event costs the host as much as a copy)."""

    def __init__(self, *values: torch.Tensor):
        if values[0].device.type != "cuda":
            self._hosts, self._ready = list(values), None
            return
        self._hosts = []
        for tensor in values:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._hosts.append(host)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def wait(self, index: int = 0) -> np.ndarray:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._hosts[index].numpy()


class PinnedStaging:
    """Pinned host buffers of ``shape`` used in turn to fill device buffers each step without waiting
    for the device: while the decode loop runs a step ahead, the copy out of one buffer may still be
    queued when the next step's values are written, so a buffer is reused only once its last copy
    has run (its event), and with two in turn that wait is on a copy a step old."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, turns: int = 2):
        self._hosts = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(turns)]
        self._copied = [torch.cuda.Event() for _ in range(turns)]
        self._turn = 0

    def next_buffer(self) -> np.ndarray:
        """The next buffer to fill (a numpy view of it), once its last copy has run."""
        self._copied[self._turn].synchronize()
        return self._hosts[self._turn].numpy()

    def copy_to(self, target: torch.Tensor) -> None:
        """Copy the buffer ``next_buffer`` returned (as much of it as ``target`` holds, from its
        start along the first dimension) into ``target``, and move to the next buffer."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        host = self._hosts[turn]
        target.copy_(host if host.shape == target.shape else host[: target.shape[0]], non_blocking=True)
        self._copied[turn].record()
