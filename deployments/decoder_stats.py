"""The engine's figures as each reader of a decoder replica wants them: ``DecoderStats`` for
/metrics (deployments/metrics.py), the autoscaling metrics deployments/autoscaling.py scales by, and
the routing report deployments/routing.py ranks replicas by."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from deployments.autoscaling import INTERACTIVE_WAITING, KV_DEMAND_BLOCKS, KV_TOTAL_BLOCKS
from deployments.routing import KVRoutingStats
from engine import EngineStats, LoopTimings


@dataclass(frozen=True)
class DecoderStats:
    """KV usage and queue depth: for /metrics, routing and autoscaling."""

    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    windows_decoded: int
    windows_aborted: int  # callers that went away (disconnects, timeouts) before their result
    tokens_generated: int
    node_id: str  # the Ray node the replica runs on (placement by resources is checked with it)
    kv_loads: int = 0  # cross-attention K/V pulls landed
    kv_load_p50_s: float = float("nan")  # of the recent pulls, from start to landing
    kv_load_p95_s: float = float("nan")
    timings: LoopTimings = field(default_factory=LoopTimings)  # the engine's step and window sums
    loop_busy_s: float = 0.0  # time the loop thread spent inside engine steps, since start

    @classmethod
    def of(
        cls,
        stats: EngineStats,
        node_id: str,
        windows_decoded: int,
        windows_aborted: int,
        tokens_generated: int,
        loop_busy_s: float,
    ) -> DecoderStats:
        """The engine's ``stats`` with its loop's sums (deployments/engine_loop.py)."""
        return cls(
            num_free_blocks=stats.num_free_blocks,
            num_used_blocks=stats.num_used_blocks,
            num_total_blocks=stats.num_total_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            windows_decoded=windows_decoded,
            windows_aborted=windows_aborted,
            tokens_generated=tokens_generated,
            node_id=node_id,
            kv_loads=stats.num_kv_loads,
            kv_load_p50_s=stats.kv_load_p50_s,
            kv_load_p95_s=stats.kv_load_p95_s,
            timings=stats.timings,
            loop_busy_s=loop_busy_s,
        )


def autoscaling_metrics(stats: EngineStats) -> dict[str, float]:
    """KV demand against the cache, and interactive windows waiting: what the decoders scale by."""
    return {
        KV_DEMAND_BLOCKS: stats.num_used_blocks + stats.waiting_blocks,
        KV_TOTAL_BLOCKS: stats.num_total_blocks,
        INTERACTIVE_WAITING: stats.num_waiting_interactive,
    }


class RoutingReports:
    """Numbered routing reports: the router tells a fresh report from one it has seen by its id."""

    def __init__(self):
        self._report_ids = itertools.count()

    def report(self, stats: EngineStats, blocks_per_window: int) -> dict[str, int]:
        return KVRoutingStats(
            report_id=next(self._report_ids),
            num_total_blocks=stats.num_total_blocks,
            num_free_blocks=stats.num_free_blocks,
            waiting_blocks=stats.waiting_blocks,
            blocks_per_window=blocks_per_window,
        ).as_dict()
