"""Which live turn's partial pass runs next on an ingress replica.

Partial text is a preview, and a replica lets only ``realtime.max_partial_passes_in_flight``
partial passes out at once, so that the queue a final pass joins in the encoders stays short
(final passes never take one of these slots). A turn that wants a pass while they are all out
waits for one, holding nothing, and a slot that comes free goes to the waiting turn that has gone
longest without a partial pass. Streams thus take turns: as they grow in number each one's passes
thin out evenly, where a slot taken by whichever stream asked first after it came free starved the
streams whose requests happened to come at the wrong moments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class PassRequest:
    """One turn's wish for a partial pass; a turn has at most one waiting."""

    # When the turn's last partial pass started (or the turn opened): the oldest goes first.
    since_s: float
    # Starts the pass now and returns it, holding the slot until it is done; None when the turn
    # no longer wants one (it may have closed since it asked), and the slot goes to the next.
    start: Callable[[], asyncio.Task | None]


class PartialSchedule:
    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        # At most one per open turn of the replica's sessions (realtime.max_sessions bounds them),
        # so the oldest is found by a scan, and a withdrawn one is simply removed.
        self._waiting: list[PassRequest] = []

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def request(self, request: PassRequest) -> None:
        """Start ``request``'s pass as soon as a slot is free and no turn that went longer
        without one waits: at once when one is free now."""
        self._waiting.append(request)
        self._grant()

    def withdraw(self, request: PassRequest | None) -> None:
        """The turn closed (final pass, clear, or its client went away): it no longer waits."""
        if request is not None and request in self._waiting:
            self._waiting.remove(request)

    def _grant(self) -> None:
        while self.in_use < self.limit and self._waiting:
            request = min(self._waiting, key=lambda waiting: waiting.since_s)
            self._waiting.remove(request)
            task = request.start()
            if task is None:
                continue
            self.in_use += 1
            task.add_done_callback(self._release)

    def _release(self, _: asyncio.Task) -> None:
        self.in_use -= 1
        self._grant()
