"""Request bodies still arriving, bounded in total and per client address.

A request takes an in-flight slot (http.max_in_flight_requests) only once its body has arrived, so
clients that open uploads and send nothing, or a byte now and then, cannot take the slots of the
requests that come whole. Their own place is this table's: when it is full (in all, or for one
client address), the upload furthest behind the minimum upload rate is cut to make room for the
new one, and only where none is behind does the newcomer get a 503. A flood of stalled uploads then
displaces itself, while an upload that arrives at a useful rate keeps its place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)  # each upload is itself: two alike are still two
class PendingUpload:
    """One body on its way: who sends it, since when, how much has come, and whether it was cut."""

    address: str
    started_s: float
    received_bytes: int = 0
    cut: asyncio.Event = field(default_factory=asyncio.Event)

    def shortfall(self, now_s: float, min_bytes_per_s: float) -> float:
        """How far the body is behind the minimum rate, in bytes (negative: ahead of it); with no
        minimum rate, its age in seconds, so that the oldest goes first."""
        elapsed_s = now_s - self.started_s
        if min_bytes_per_s <= 0:
            return elapsed_s
        return min_bytes_per_s * elapsed_s - self.received_bytes


class UploadsFull(Exception):
    """No room for another upload, and none of the pending ones is behind the minimum rate."""


class PendingUploads:
    def __init__(
        self,
        max_uploads: int,
        max_uploads_per_address: int,
        min_bytes_per_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_uploads = max_uploads
        self.max_uploads_per_address = max_uploads_per_address
        self.min_bytes_per_s = min_bytes_per_s
        self.clock = clock
        self._uploads: dict[str, list[PendingUpload]] = {}  # by client address
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def admit(self, address: str) -> PendingUpload:
        """A new upload from ``address``, made room for by cutting the pending upload furthest
        behind the minimum rate (of that address, when it is the address's bound that is reached).
        Raises UploadsFull where none is behind."""
        from_address = self._uploads.get(address, [])
        if len(from_address) >= self.max_uploads_per_address:
            self._cut_the_slowest(from_address)
        elif self._count >= self.max_uploads:
            self._cut_the_slowest([upload for uploads in self._uploads.values() for upload in uploads])
        upload = PendingUpload(address, self.clock())
        self._uploads.setdefault(address, []).append(upload)
        self._count += 1
        return upload

    def finish(self, upload: PendingUpload) -> None:
        """``upload``'s body has come (or failed): its place is free. A cut upload's is already."""
        uploads = self._uploads.get(upload.address, [])
        if upload in uploads:
            self._remove(upload)

    def _cut_the_slowest(self, candidates: list[PendingUpload]) -> None:
        now_s = self.clock()
        slowest = max(candidates, key=lambda upload: upload.shortfall(now_s, self.min_bytes_per_s))
        if self.min_bytes_per_s > 0 and slowest.shortfall(now_s, self.min_bytes_per_s) <= 0:
            raise UploadsFull
        self._remove(slowest)
        slowest.cut.set()

    def _remove(self, upload: PendingUpload) -> None:
        uploads = self._uploads[upload.address]
        uploads.remove(upload)
        if not uploads:
            del self._uploads[upload.address]
        self._count -= 1
