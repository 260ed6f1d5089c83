"""Copies between host and device that never make the host wait for the GPU.

A plain ``tensor.to("cuda")`` from ordinary host memory, or ``.tolist()`` of a device tensor,
waits for everything queued on the stream. The decode loop launches step N+1 before it reads
step N's tokens (engine/decode/pipeline.py), so a single such copy in the step would put the GPU's whole
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
