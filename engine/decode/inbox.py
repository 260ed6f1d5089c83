"""Work handed to the decode loop from other threads: new requests and aborts.

``submit`` and ``abort`` may be called from any thread (a deployment's event loop); the thread
that runs the engine's steps takes what arrived at its next step boundary.
"""

from __future__ import annotations

import queue
import time

from engine.decode.request import Request


class Inbox:
    def __init__(self) -> None:
        # Each with when it was submitted (time.monotonic()): its wait for the loop counts as queued.
        self._requests: queue.SimpleQueue[tuple[Request, float]] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()

    def submit(self, request: Request) -> None:
        self._requests.put((request, time.monotonic()))

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)

    @property
    def num_requests(self) -> int:
        return self._requests.qsize()

    @property
    def empty(self) -> bool:
        return self._requests.empty()

    def take_requests(self) -> list[tuple[Request, float]]:
        """The requests submitted since the last call, each with when it was submitted."""
        return _drain(self._requests)

    def take_aborts(self) -> list[str]:
        return _drain(self._aborts)


def _drain(items: queue.SimpleQueue) -> list:
    taken = []
    while not items.empty():
        taken.append(items.get())
    return taken
