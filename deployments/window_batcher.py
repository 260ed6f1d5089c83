"""Windows waiting for an encoder forward, batched: used by encoder replicas and by colocated
workers (an encoder and a decoder in one replica, deployments/colocated_encoder.py).

Windows queue inside the replica where interactive ones go first (Serve's own ``serve.batch`` is
first come, first served); batch windows fill the room interactive ones leave in a forward, since a
window that waits for a later forward holds its request back and spends the GPU on one more small
batch. While both kinds wait, the oldest batch windows are owed ``batch_share`` of each forward's
places (engine/types.py ``batch_places``), so a long file's windows are encoded however many
interactive ones keep arriving. How long a forward waits to fill is the owner's call
(``fill_wait_ms``, read before each forward), and so is whether one may start at all
(``may_start``: a colocated worker holds windows back while its decoder has a queue, so encoded
windows never pile up in GPU memory).

A forward hands each window's outcome to its caller as soon as it has it, not when the batch is done:
an encoder replica stages its windows one by one into staging that only a decoder's pull frees, and
a window held back until the last was staged could never be pulled to make room for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from engine.types import Priority, batch_places, is_promoted

logger = logging.getLogger("ray.serve")

Outcome = TypeVar("Outcome")

# How often a forward that may not start yet (``may_start``) asks again.
START_POLL_S = 0.002


@dataclass(frozen=True)
class WindowJob:
    """One window to encode: what crosses from the ingress to an encoder."""

    request_id: str  # unique per window; a transfer handle carries it to the decoder
    samples: np.ndarray  # float32, 16 kHz mono, at most 30 s
    priority: Priority = Priority.INTERACTIVE
    # Encoder frames to encode it over (engine's context_frames); None: the full 30 s window.
    encoder_frames: int | None = None


def by_encoder_frames(jobs: list[WindowJob]) -> dict[int | None, list[int]]:
    """A batch's windows (their indexes) by the encoder frames they are encoded over, in the order
    of each context's first window: a forward runs one shape, so a batch of several contexts runs
    one forward per context."""
    groups: dict[int | None, list[int]] = {}
    for index, job in enumerate(jobs):
        groups.setdefault(job.encoder_frames, []).append(index)
    return groups


def encode_by_context(
    jobs: list[WindowJob], encode: Callable[[int | None, list[WindowJob]], Iterable[Outcome]]
) -> Iterator[Outcome]:
    """Each window's outcome in the batch's order, ``encode`` (frames, that context's windows)
    called once per context. An outcome is handed on once its context's forward is done, not the
    batch's: the batcher orders a batch by context, its most urgent window's first, so a final
    pass's window never waits for the partial passes' forwards after it."""
    outcomes: dict[int, Outcome] = {}
    next_index = 0
    for frames, indexes in by_encoder_frames(jobs).items():
        outcomes.update(zip(indexes, encode(frames, [jobs[index] for index in indexes])))
        while next_index in outcomes:
            yield outcomes.pop(next_index)
            next_index += 1


@dataclass(eq=False)  # compared by identity: the queue removes exactly this window
class QueuedWindow:
    job: WindowJob
    done: asyncio.Future  # the forward's outcome for this window, or the exception that failed it
    arrived_s: float  # time.monotonic()


class WindowBatcher(Generic[Outcome]):
    def __init__(
        self,
        forward: Callable[[list[WindowJob]], Iterable[Outcome | Exception]],
        max_batch_size: int,
        batch_aging_s: float,
        fill_wait_ms: Callable[[], float],
        may_start: Callable[[], bool] = lambda: True,
        discard: Callable[[Outcome], None] = lambda outcome: None,
        batch_share: float = 0.0,
    ):
        """``forward``: encodes a batch in a worker thread, yielding one outcome (or exception) per
        window in the batch's order, each handed on as it is yielded; ``discard``: frees an outcome
        whose caller went away during its forward; ``batch_share``: engine.batch_share."""
        self.forward = forward
        self.max_batch_size = max_batch_size
        self.batch_aging_s = batch_aging_s
        self.batch_windows_owed = batch_places(max_batch_size, batch_share)
        self.fill_wait_ms = fill_wait_ms
        self.may_start = may_start
        self.discard = discard
        # Counted as they happen, so a caller that has its outcome finds its window counted: a
        # forward counts when it starts, a window when its outcome is handed on.
        self.windows_encoded = 0
        self.batches = 0
        self.encoder_forwards = 0  # a batch runs one for each context among its windows
        self.last_batch_size = 0
        # Sums since start (/metrics): each window's wait from arrival to its forward's start, each
        # window's forward (from its start until the window's outcome was handed on), the forwards'
        # own time, and of it the time ``forward`` ran on its worker thread (the rest is the hand-over
        # to the thread and back to the loop).
        self.queued_s = self.window_forward_s = self.busy_s = self.worker_s = 0.0
        self._queue: list[QueuedWindow] = []  # in arrival order
        self._in_forward = 0
        self._window_arrived: asyncio.Event | None = None  # made on the replica's event loop, at first use
        self._batch_loop: asyncio.Task | None = None

    @property
    def num_pending(self) -> int:
        """Windows queued or in the forward now."""
        return len(self._queue) + self._in_forward

    @property
    def mean_batch_size(self) -> float:
        return self.windows_encoded / self.batches if self.batches else 0.0

    async def submit(self, job: WindowJob) -> Outcome:
        """Encode one window, batched with others waiting meanwhile; its outcome, or its exception."""
        if self._batch_loop is None:
            self._window_arrived = asyncio.Event()
            self._batch_loop = asyncio.create_task(self._run_batches())
        window = QueuedWindow(job, asyncio.get_running_loop().create_future(), time.monotonic())
        self._queue.append(window)
        self._window_arrived.set()
        try:
            return await window.done
        finally:
            if window in self._queue:  # the caller went away before its forward: drop the window
                self._queue.remove(window)

    async def _run_batches(self) -> None:
        while True:
            await self._window_arrived.wait()
            self._window_arrived.clear()
            await self._let_batch_fill()
            while self._queue:
                while not self.may_start():
                    await asyncio.sleep(START_POLL_S)
                if not self._queue:  # every waiting caller went away meanwhile
                    break
                await self._forward(self._next_batch())

    async def _forward(self, batch: list[QueuedWindow]) -> None:
        self._in_forward = len(batch)
        self.batches += 1
        self.encoder_forwards += len({window.job.encoder_frames for window in batch})
        self.last_batch_size = len(batch)
        started = time.monotonic()
        self.queued_s += sum(started - window.arrived_s for window in batch)
        loop = asyncio.get_running_loop()
        handed_on = 0  # outcomes come in the batch's order: the first ``handed_on`` windows have theirs

        def hand_on(window: QueuedWindow, outcome: Outcome | Exception) -> None:  # on the event loop
            nonlocal handed_on
            handed_on += 1
            self._in_forward -= 1
            self.windows_encoded += 1
            self.window_forward_s += time.monotonic() - started
            self._settle(window, outcome)

        failure: Exception | None = None
        try:
            # In a worker thread, so the replica's event loop keeps answering health checks, queueing
            # windows and handing on this forward's outcomes while the encoder computes. The worker's
            # hand-overs reach the loop before its return does (callbacks run in the order queued).
            await asyncio.to_thread(
                self._forward_on_worker, batch, lambda *pair: loop.call_soon_threadsafe(hand_on, *pair)
            )
        except Exception as error:  # the forward failed: every window it had not handed on fails, loudly
            logger.exception("encoder forward failed")
            failure = error
        finally:
            self.busy_s += time.monotonic() - started
        for window in batch[handed_on:]:
            left_out = RuntimeError(f"the encoder's forward gave no outcome for {window.job.request_id}")
            hand_on(window, failure or left_out)

    def _forward_on_worker(
        self, batch: list[QueuedWindow], hand_on: Callable[[QueuedWindow, Outcome | Exception], None]
    ) -> None:
        """Runs the forward, handing each window's outcome on as it comes."""
        began = time.monotonic()
        try:
            # The forward first: after the batch's last window, zip asks it once more, and it finishes.
            for outcome, window in zip(self.forward([window.job for window in batch]), batch):
                hand_on(window, outcome)
        finally:
            self.worker_s += time.monotonic() - began  # one forward at a time: one writer

    def _settle(self, window: QueuedWindow, outcome: Outcome | Exception) -> None:
        if window.done.cancelled() and not isinstance(outcome, Exception):
            # Its caller went away during the forward (a client that hung up): free what the forward
            # made now rather than when a timeout would.
            self.discard(outcome)
        elif window.done.done():
            return
        elif isinstance(outcome, Exception):
            window.done.set_exception(outcome)
        else:
            window.done.set_result(outcome)

    async def _let_batch_fill(self) -> None:
        """Wait until the queue holds a full batch or the fill time passes."""
        deadline = time.monotonic() + self.fill_wait_ms() / 1000
        while len(self._queue) < self.max_batch_size and (left_s := deadline - time.monotonic()) > 0:
            self._window_arrived.clear()
            try:
                await asyncio.wait_for(self._window_arrived.wait(), timeout=left_s)
            except asyncio.TimeoutError:
                break

    def _next_batch(self) -> list[QueuedWindow]:
        """The oldest interactive (or aged batch) windows waiting, less the places owed to batch
        windows, then the oldest batch ones; ordered by context (``encode_by_context``), each
        context where its first window came."""
        now = time.monotonic()
        interactive, batch_work = [], []  # each in arrival order
        for window in self._queue:
            promoted = is_promoted(window.job.priority, now - window.arrived_s, self.batch_aging_s)
            (interactive if promoted else batch_work).append(window)
        owed = min(len(batch_work), self.batch_windows_owed)
        batch = interactive[: self.max_batch_size - owed]
        batch += batch_work[: self.max_batch_size - len(batch)]
        for window in batch:
            self._queue.remove(window)
        contexts = by_encoder_frames([window.job for window in batch]).values()
        return [batch[index] for indexes in contexts for index in indexes]
