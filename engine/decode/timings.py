"""Where the decode loop's time goes, summed since start: how many sequences each step ran, and
how long each decoded window waited for admission, for its K/V (for a loader worker, for the pull,
for the loop to notice it had landed), and then decoded.

A served app gives its engine's throughput away in two ways: steps that run fewer sequences than
they could (windows spend their time elsewhere: in the encoder, in transit, queued), and steps that
take longer (the GPU or the process shared with other work). These sums tell the two apart:
rows per step is the first, loop-busy seconds per step the second; and of a step's time, how much
the loop waited for the device to hand a step's tokens back (a GPU shared with other kernels shows
there) rather than doing its own host work (a process whose other threads hold the GIL shows
there). Deployments export them at /metrics; benchmarks/bench_load.py turns their differences
over a run into means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowTimes:
    """When one window passed each stage (time.monotonic() readings, in this order)."""

    submitted_s: float
    admitted_s: float
    load_started_s: float
    load_ended_s: float
    runnable_s: float
    finished_s: float


@dataclass
class LoopTimings:
    steps: int = 0  # decoder forwards launched
    rows: int = 0  # sequences those forwards ran, summed (a search's hypotheses each count)
    read_wait_s: float = 0.0  # reading steps' tokens back: mostly waiting for the device to finish them
    windows: int = 0  # decoded windows (stopped or at their length) the three sums below cover
    queued_s: float = 0.0  # submitted -> admitted: waiting for a slot or KV blocks
    loading_s: float = 0.0  # admitted -> its cross-attention K/V landed in its blocks
    decoding_s: float = 0.0  # landed -> finished: the steps it ran in
    # loading_s in three parts, for K/V that travels (zero for K/V written at admission):
    load_queued_s: float = 0.0  # admitted -> a loader worker began its load
    load_pulling_s: float = 0.0  # the load itself: the pull and its copy into the blocks
    load_landed_s: float = 0.0  # the load ended -> the decode loop saw it (its next step)

    def count_step(self, rows: int) -> None:
        self.steps += 1
        self.rows += rows

    def count_read(self, seconds: float) -> None:
        self.read_wait_s += seconds

    def count_window(self, times: WindowTimes) -> None:
        """One decoded window's times."""
        self.windows += 1
        self.queued_s += times.admitted_s - times.submitted_s
        self.loading_s += times.runnable_s - times.admitted_s
        self.decoding_s += times.finished_s - times.runnable_s
        self.load_queued_s += times.load_started_s - times.admitted_s
        self.load_pulling_s += times.load_ended_s - times.load_started_s
        self.load_landed_s += times.runnable_s - times.load_ended_s

    def snapshot(self) -> LoopTimings:
        return dataclasses.replace(self)
