"""The decoded audio an ingress replica holds at once, bounded in seconds of samples across its
requests (http.max_decoded_audio_s), so that its memory follows what the audio costs decoded,
not its bytes on the wire: a small FLAC of silence can be an hour of samples.

A request's samples are counted from the moment its decoding process reports how many there are
(before they cross into the replica; the worker holds them while the request waits for room) until
the array is freed, whichever way the request ends: a streamed response holds them until its stream
is done, and a failed one gives them back as soon as nothing refers to them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from engine import SAMPLE_RATE
from engine.errors import NoRoomError


class DecodedAudio:
    """Holds are taken on decoding threads (they wait there, off the event loop) and given back
    wherever an array is freed; a lock-guarded condition serves both."""

    def __init__(self, max_seconds: float, wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_samples = int(max_seconds * SAMPLE_RATE)
        self.wait_s = wait_s
        self.clock = clock
        self._held_samples = 0
        self._room = threading.Condition()

    @property
    def held_s(self) -> float:
        return self._held_samples / SAMPLE_RATE

    def hold(self, samples: int) -> None:
        """Take room for ``samples``, waiting up to ``wait_s`` for others to give theirs back;
        raises NoRoomError after. One request alone always fits (the config's validator keeps
        http.max_decoded_audio_s at least http.max_audio_duration_s)."""
        deadline_s = self.clock() + self.wait_s
        with self._room:
            while self._held_samples + samples > self.max_samples and self._held_samples:
                remaining_s = deadline_s - self.clock()
                if remaining_s <= 0:
                    raise NoRoomError("the decoded audio this replica holds", self.wait_s)
                self._room.wait(remaining_s)
            self._held_samples += samples

    def release(self, samples: int) -> None:
        with self._room:
            self._held_samples -= samples
            self._room.notify_all()

    def decoded(
        self,
        decode: Callable[..., np.ndarray],
        data: bytes,
        max_duration_s: float,
        split_channels: bool = False,
    ) -> np.ndarray:
        """``data``'s samples by ``decode`` (DecodeProcesses.decode, which calls ``hold`` with their
        count before they cross), held here until the array is freed; with ``split_channels``
        [channels, samples], every channel's samples counted."""
        held: list[int] = []

        def hold(samples: int) -> None:
            self.hold(samples)
            held.append(samples)

        try:
            if split_channels:
                samples = decode(data, max_duration_s, hold, split_channels=True)
            else:
                samples = decode(data, max_duration_s, hold)
        except BaseException:
            for count in held:
                self.release(count)
            raise
        for count in held:
            self.held_until_freed(samples, count)
        return samples

    def held_until_freed(self, array: np.ndarray, samples: int) -> None:
        """Give ``samples`` back when ``array`` (and every view of it) is freed."""
        weakref.finalize(array, self.release, samples)
