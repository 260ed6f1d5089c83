"""The encoder's window batching under priorities: while interactive windows keep every forward
full, a long file sent as batch work still gets ``batch_share`` of each forward's windows, on the
real batcher and its event loop (the forward itself, not under test, hands back each window's id)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from deployments.window_batcher import WindowBatcher, WindowJob, by_encoder_frames
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
