"""A request's phases in the ingress, as a ``Server-Timing`` response header."""

from __future__ import annotations

import time
from collections.abc import Callable


class ServerTiming:
    """A request's phases in the ingress, sent back as a ``Server-Timing`` header (milliseconds; the
    W3C header browsers' developer tools show): where a request's time went on the server, against
    what its client saw (benchmarks/bench_load.py averages them)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last = clock()
        self._phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """``phase`` ended now; it began where the last one ended."""
        now = self._clock()
        self._phases.append((phase, now - self._last))
        self._last = now

    def header(self) -> str:
        return ", ".join(f"{phase};dur={seconds * 1000:.1f}" for phase, seconds in self._phases)
