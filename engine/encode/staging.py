"""A batch of windows' samples on their way to the encoder, through one buffer kept for the
encoder's life.

Stacking a batch's windows into a new array costs more than it looks: each forward allocates tens
of megabytes (a 30 s window is 1.9 MB of float32), the fresh pages fault in as they are written,
and on a GPU the pageable array is then copied once more into the driver's staging memory on its
way to the device. The encoder's worker thread spends that time holding the GIL that a colocated
decode loop needs. Here each window is copied once, into a row of a reused buffer (page-locked on a
GPU, so the copy to the device is a DMA on the encoder's stream that the thread does not wait for),
padded with zeros or trimmed to 30 s as it goes.

A row is rewritten only once the device has read it: each fill waits for the previous batch's
copy (long finished by then: the encoder's kernels came after it on the same stream).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from engine.model.audio import N_SAMPLES


class WindowStaging:
    def __init__(self, device: torch.device, rows: int = 0):
        """``rows``: the batch to size the buffer for now; a larger batch grows it."""
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = self._allocate(rows)
        self._copied: torch.cuda.Event | None = None  # the last batch's copy to the device
        self._lock = threading.Lock()

    @property
    def page_locked(self) -> bool:
        return self._host.is_pinned()

    def to_device(self, windows: Sequence[np.ndarray]) -> torch.Tensor:
        """[len(windows), N_SAMPLES] float32 on the device, each row a window's samples (16 kHz
        mono) padded or trimmed to 30 s. On a GPU the copy is queued on the current stream; on a
        CPU the result is the buffer itself, valid until the next call."""
        with self._lock:
            if self._copied is not None:
                self._copied.synchronize()
            if len(windows) > len(self._host):
                self._host = self._allocate(len(windows))
            batch = self._host[: len(windows)]
            rows = batch.numpy()
            for row, samples in zip(rows, windows):
                length = min(len(samples), N_SAMPLES)
                row[:length] = samples[:length]
                row[length:] = 0.0
            if not self._pinned:
                return batch
            on_device = batch.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            return on_device

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, N_SAMPLES, dtype=torch.float32, pin_memory=self._pinned)
