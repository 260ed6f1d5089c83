"""Bounded staging, shared by every sender: a fixed budget of bytes carved first-fit, a wait
(back-pressure) when it is full, and a service thread that frees each entry once it is pulled or
once it has waited unclaimed too long.

Connectors differ only in where the bytes live and how a pull is noticed; ``StagingSender`` is
the part they share, ``StagingBuffer`` the preallocated tensor that local and NIXL staging use.
"""

from __future__ import annotations

import abc
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.arith import round_up
from kv_transfer.base import BlockLayout, KVSender, StagingFullError, TransferHandle, TransferPayload
from kv_transfer.config import TransferConfig

logger = logging.getLogger(__name__)

# Every staged region starts on this boundary: keeps each dtype's alignment, and CUDA copies fast.
STAGING_ALIGNMENT = 256


def synchronize(device: torch.device) -> None:
    """Wait for this thread's queued work on a CUDA device: before bytes are announced (a handle
    leaves) or handed to NIXL, whose copies run outside torch's streams."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _aligned(nbytes: int) -> int:
    return round_up(nbytes, STAGING_ALIGNMENT)


class StagingArena:
    """Offsets in [0, capacity_bytes) handed out first-fit; freed neighbours merge again. It never
    grows: ``allocate`` waits for a ``free`` up to ``wait_s``, then raises StagingFullError."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._free_ranges: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, size), by offset
        self._used: dict[int, int] = {}  # offset -> size
        self._changed = threading.Condition()
        self._closed = False

    def allocate(self, nbytes: int, wait_s: float) -> int:
        size = _aligned(nbytes)
        if size > self.capacity_bytes:
            raise StagingFullError(
                f"a {nbytes / 2**20:.1f} MB payload can never fit {self.capacity_bytes / 2**20:.1f} MB of "
                "staging: raise transfer.staging_memory_mb"
            )
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                if self._closed:
                    raise StagingFullError("the sender is closed")
                offset = self._take(size)
                if offset is not None:
                    return offset
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StagingFullError(
                        f"staging stayed full for {wait_s:.1f} s ({sum(self._used.values()) / 2**20:.1f} of "
                        f"{self.capacity_bytes / 2**20:.1f} MB held by {len(self._used)} requests waiting "
                        "to be pulled)"
                    )
                self._changed.wait(remaining)

    def free(self, offset: int) -> None:
        with self._changed:
            size = self._used.pop(offset)
            ranges = sorted([*self._free_ranges, (offset, size)])
            merged = [ranges[0]]
            for start, length in ranges[1:]:
                last_start, last_length = merged[-1]
                if last_start + last_length == start:
                    merged[-1] = (last_start, last_length + length)
                else:
                    merged.append((start, length))
            self._free_ranges = merged
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _take(self, size: int) -> int | None:
        for index, (offset, length) in enumerate(self._free_ranges):
            if length >= size:
                if length == size:
                    del self._free_ranges[index]
                else:
                    self._free_ranges[index] = (offset + size, length - size)
                self._used[offset] = size
                return offset
        return None


@dataclass
class StagedEntry:
    token: int  # unique per sender; never 0 (0 marks a released header)
    request_id: str
    offset: int  # into the staging arena
    layout: BlockLayout
    staged_at_s: float  # time.monotonic()
    claimed: bool = False  # a same-process receiver is copying it: neither expiry nor release may free it


class StagingSender(KVSender):
    """Staging bookkeeping every connector shares. A subclass says where the bytes go (``_write``),
    what freeing means for it (``_discard``) and how it learns of finished pulls (``_wait_pulled``),
    then calls ``_start_service`` once it is ready."""

    connector: str
    header_bytes = 0  # bytes before each entry's payload (the staging buffer's token slot)

    def __init__(self, config: TransferConfig, block_size: int, sender_id: str):
        self.config = config
        self.block_size = block_size
        self.sender_id = sender_id
        self.arena = StagingArena(int(config.staging_memory_mb * 2**20))
        self._entries: dict[int, StagedEntry] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._closed = threading.Event()
        self._service = threading.Thread(target=self._service_loop, name=f"{sender_id}-release", daemon=True)

    def stage(self, request_id: str, payload: torch.Tensor, kind: TransferPayload) -> TransferHandle:
        layout = BlockLayout.of(payload, kind, self.block_size)
        offset = self.arena.allocate(self.staged_bytes(layout), self.config.stage_wait_s)
        entry = StagedEntry(next(self._tokens), request_id, offset, layout, time.monotonic())
        try:
            location = self._write(entry, layout.to_staged(payload))
        except BaseException:
            self.arena.free(offset)
            raise
        with self._lock:
            self._entries[entry.token] = entry
        return TransferHandle(
            request_id=request_id,
            connector=self.connector,
            sender_id=self.sender_id,
            layout=layout,
            location=location,
            created_at_s=time.time(),
            staging_token=entry.token,
        )

    def release(self, request_id: str) -> None:
        with self._lock:
            tokens = [t for t, e in self._entries.items() if e.request_id == request_id and not e.claimed]
        for token in tokens:
            self._free(token, pulled=False)

    @property
    def num_staged(self) -> int:
        with self._lock:
            return len(self._entries)

    @classmethod
    def staged_bytes(cls, layout: BlockLayout) -> int:
        return _aligned(cls.header_bytes + layout.nbytes)

    def holds_at_once(self, layout: BlockLayout) -> int:
        return self.arena.capacity_bytes // self.staged_bytes(layout)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._service.is_alive():
            self._service.join()
        with self._lock:
            tokens = list(self._entries)
        for token in tokens:
            self._free(token, pulled=False)
        self.arena.close()

    # --- for subclasses --------------------------------------------------------------------

    @abc.abstractmethod
    def _write(self, entry: StagedEntry, staged: torch.Tensor) -> Any:
        """Put ``staged`` (layout.staged_shape) into the entry's staging; return the handle's location."""

    def _discard(self, entry: StagedEntry, pulled: bool) -> None:
        """Called as an entry is freed, before its bytes may be reused."""

    def _wait_pulled(self, timeout_s: float) -> list[int]:
        """Tokens of entries whose pull finished, waiting up to ``timeout_s`` for some."""
        self._closed.wait(timeout_s)
        return []

    def _start_service(self) -> None:
        self._service.start()

    def _claim(self, token: int) -> StagedEntry | None:
        """Take an entry for a same-process copy: after this only ``_free`` releases it."""
        with self._lock:
            entry = self._entries.get(token)
            if entry is None or entry.claimed:
                return None
            entry.claimed = True
            return entry

    def _free(self, token: int, pulled: bool) -> bool:
        with self._lock:
            entry = self._entries.pop(token, None)
        if entry is None:
            return False
        self._discard(entry, pulled)
        self.arena.free(entry.offset)
        return True

    # --- the service thread ----------------------------------------------------------------

    def _service_loop(self) -> None:
        interval_s = self.config.release_poll_interval_ms / 1000
        next_expiry_s = 0.0
        while not self._closed.is_set():
            try:
                for token in self._wait_pulled(interval_s):
                    self._free(token, pulled=True)
                if time.monotonic() >= next_expiry_s:  # a poll may come far more often than this
                    self._expire()
                    next_expiry_s = time.monotonic() + interval_s
            except Exception:
                # The loop must outlive one bad poll: without it nothing is ever freed again.
                logger.exception("kv sender %s: release poll failed", self.sender_id)
                self._closed.wait(interval_s)

    def _expire(self) -> None:
        oldest_kept = time.monotonic() - self.config.unclaimed_timeout_s
        with self._lock:
            stale = [e for e in self._entries.values() if e.staged_at_s < oldest_kept and not e.claimed]
        for entry in stale:
            if self._free(entry.token, pulled=False):
                logger.warning(
                    "staging for %s was not pulled within %.0f s (unclaimed_timeout_s); freed",
                    entry.request_id,
                    self.config.unclaimed_timeout_s,
                )


class StagingBuffer:
    """The staging tensor, allocated once. Each entry is a header slot holding its token, then the
    payload. The token lets a reader that cannot ask the sender (a one-sided NIXL READ) check
    that the region still holds its entry: a freed entry's slot reads 0, a reused one another token."""

    header_bytes = STAGING_ALIGNMENT

    def __init__(self, capacity_bytes: int, device: torch.device):
        self.device = device
        self.tensor = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)

    def write(self, entry: StagedEntry, staged: torch.Tensor) -> None:
        header = self._token_slot(entry.offset)
        header.fill_(0)  # first: from here on a reader of the entry this region held must fail
        self.payload(entry).copy_(staged)
        header.fill_(entry.token)
        synchronize(self.device)  # the handle must not leave before its bytes are in place

    def clear(self, entry: StagedEntry) -> None:
        self._token_slot(entry.offset).fill_(0)
        synchronize(self.device)  # before the region is reused, perhaps from another thread's stream

    def payload(self, entry: StagedEntry) -> torch.Tensor:
        start = entry.offset + self.header_bytes
        region = self.tensor[start : start + entry.layout.nbytes]
        return region.view(entry.layout.torch_dtype).view(entry.layout.staged_shape)

    def header_address(self, entry: StagedEntry) -> int:
        return self.tensor.data_ptr() + entry.offset

    def payload_address(self, entry: StagedEntry) -> int:
        return self.tensor.data_ptr() + entry.offset + self.header_bytes

    def _token_slot(self, offset: int) -> torch.Tensor:
        return self.tensor[offset : offset + 8].view(torch.int64)
