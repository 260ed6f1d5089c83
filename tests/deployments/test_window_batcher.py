"""The encoder's window batching under priorities: while interactive windows keep every forward
full, a long file sent as batch work still gets ``batch_share`` of each forward's windows, on the
real batcher and its event loop (the forward itself, not under test, hands back each window's id)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from deployments.window_batcher import WindowBatcher, WindowJob, by_encoder_frames, encode_by_context
from engine import SAMPLE_RATE, context_frames
from engine.types import Priority

MAX_BATCH_SIZE = 8
INTERACTIVE_CLIENTS = 3 * MAX_BATCH_SIZE  # each sends its next window as soon as its last is back
FILE_WINDOWS = 10


def _a_long_file_under_interactive_saturation(
    batch_share: float, forwards_after_arrival: int
) -> list[list[Priority]]:
    """Each forward's windows' priorities, from the file's arrival (the first may have been chosen
    just before it) until the file is done or ``forwards_after_arrival`` forwards have run."""
    forwards: list[list[Priority]] = []
    lock = threading.Lock()

    def forward(jobs: list[WindowJob]) -> list[str]:  # on the batcher's worker thread
        with lock:
            forwards.append([job.priority for job in jobs])
        return [job.request_id for job in jobs]

    async def scenario() -> int:
        batcher = WindowBatcher(
            forward, MAX_BATCH_SIZE, batch_aging_s=1e9, fill_wait_ms=lambda: 0.0, batch_share=batch_share
        )
        samples = np.zeros(16000, dtype=np.float32)
        stop = asyncio.Event()

        async def interactive_client(client: int) -> None:
            sent = 0
            while not stop.is_set():
                await batcher.submit(WindowJob(f"c{client}-{sent}", samples, Priority.INTERACTIVE))
                sent += 1

        clients = [asyncio.create_task(interactive_client(client)) for client in range(INTERACTIVE_CLIENTS)]
        while batcher.batches < 3:  # saturated before the file arrives
            await asyncio.sleep(0.001)
        file_windows = asyncio.gather(
            *(batcher.submit(WindowJob(f"file-{i}", samples, Priority.BATCH)) for i in range(FILE_WINDOWS))
        )
        await asyncio.sleep(0)  # the file's windows are queued: their first steps ran before this one
        with lock:
            arrived_at = len(forwards)
        while not file_windows.done() and batcher.batches < arrived_at + forwards_after_arrival:
            await asyncio.sleep(0.001)
        stop.set()
        file_windows.cancel()
        for client in clients:
            client.cancel()
        return arrived_at

    arrived_at = asyncio.run(asyncio.wait_for(scenario(), 60))
    return forwards[arrived_at:]


def test_under_interactive_saturation_a_long_files_windows_get_batch_share_of_every_forward():
    forwards = _a_long_file_under_interactive_saturation(batch_share=0.25, forwards_after_arrival=50)
    owed = 2  # 0.25 of 8 windows
    file_counts = [priorities.count(Priority.BATCH) for priorities in forwards]
    first = file_counts.index(owed)
    assert first <= 1, "the file waits at most for a forward chosen before it arrived"
    done = first + FILE_WINDOWS // owed
    assert file_counts[first:done] == [owed] * (FILE_WINDOWS // owed), "its share of every forward until done"
    assert sum(file_counts) == FILE_WINDOWS
    assert all(len(priorities) == MAX_BATCH_SIZE for priorities in forwards[:done]), "every forward full"


def test_with_no_batch_share_a_long_files_windows_wait_behind_interactive_saturation():
    """batch_share 0: interactive windows fill every forward and the file starves (only batch_aging_s
    would rescue it), so the test above can fail."""
    forwards = _a_long_file_under_interactive_saturation(batch_share=0.0, forwards_after_arrival=30)
    assert len(forwards) >= 29
    assert all(priorities == [Priority.INTERACTIVE] * MAX_BATCH_SIZE for priorities in forwards)


def test_a_batch_over_several_encoder_contexts_runs_one_forward_per_context_each_in_window_order():
    samples = np.zeros(16000, dtype=np.float32)
    jobs = [
        WindowJob(f"w{i}", samples, encoder_frames=frames) for i, frames in enumerate([100, None, 100, 250])
    ]
    assert by_encoder_frames(jobs) == {100: [0, 2], None: [1], 250: [3]}


def _one_batch(jobs: list[WindowJob]) -> tuple[WindowBatcher, list[list[str]], list[tuple[str, float]]]:
    """``jobs`` queued together and encoded in one batch by a forward that encodes each context
    with ``encode_by_context``: the batcher, each encoder forward's windows, and when each window's
    outcome reached its caller (a context's forward takes 200 ms: the 30 ms margins the tests assert
    leave room for a loaded machine to wake the caller late)."""
    forwards: list[list[str]] = []

    def encode(frames: int | None, context_jobs: list[WindowJob]) -> list[str]:
        forwards.append([job.request_id for job in context_jobs])
        time.sleep(0.2)
        return [job.request_id for job in context_jobs]

    async def scenario() -> tuple[WindowBatcher, list[tuple[str, float]]]:
        batcher = WindowBatcher(
            lambda batch: encode_by_context(batch, encode),
            len(jobs),
            batch_aging_s=1e9,
            fill_wait_ms=lambda: 1e3,
        )
        arrivals: list[tuple[str, float]] = []

        async def submit(job: WindowJob) -> None:
            assert await batcher.submit(job) == job.request_id
            arrivals.append((job.request_id, time.monotonic()))

        await asyncio.gather(*(submit(job) for job in jobs))
        return batcher, arrivals

    batcher, arrivals = asyncio.run(asyncio.wait_for(scenario(), 30))
    return batcher, forwards, arrivals


def test_concurrent_partial_passes_of_different_lengths_in_one_context_step_share_one_encoder_forward():
    """Partial passes over 3.0 to 7.5 s of audio, as live streams send them at once: in whole
    seconds they are five contexts, five forwards; rounded up to a 10 s step they are one."""
    lengths_s = [3.0, 3.4, 4.2, 5.1, 6.5, 7.5]
    for step_s, contexts in ((1, 5), (10, 1)):
        jobs = [
            WindowJob(
                f"p{i}",
                np.zeros(int(seconds * SAMPLE_RATE), dtype=np.float32),
                Priority.BATCH,
                context_frames(int(seconds * SAMPLE_RATE), min_s=5.0, pad_s=1.0, step_s=step_s),
            )
            for i, seconds in enumerate(lengths_s)
        ]
        batcher, forwards, _ = _one_batch(jobs)
        assert batcher.batches == 1, "one batch"
        assert batcher.encoder_forwards == len(forwards) == contexts, (step_s, forwards)


def test_a_final_pass_batched_with_partial_passes_is_encoded_first_and_handed_on_before_their_forwards():
    """Partial passes (batch work) of two contexts queued before a final pass (interactive, the full
    window): the final's context runs first, and its caller has it before the others' forwards end."""
    samples = np.zeros(SAMPLE_RATE, dtype=np.float32)
    jobs = [
        WindowJob("partial-10s-a", samples, Priority.BATCH, 500),
        WindowJob("partial-20s", samples, Priority.BATCH, 1000),
        WindowJob("partial-10s-b", samples, Priority.BATCH, 500),
        WindowJob("final", samples, Priority.INTERACTIVE, None),
    ]
    batcher, forwards, arrivals = _one_batch(jobs)
    assert forwards == [["final"], ["partial-10s-a", "partial-10s-b"], ["partial-20s"]]
    assert batcher.encoder_forwards == 3
    handed_on = dict(arrivals)
    assert handed_on["final"] < handed_on["partial-10s-a"] - 0.03, "not held back for the next forward"
    assert handed_on["partial-10s-b"] < handed_on["partial-20s"] - 0.03
