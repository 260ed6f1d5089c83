"""Routing windows to the decoder replica with the most free KV blocks.

Serve's default router picks the shorter queue of two random replicas. For decoders the queue
length says little: a replica with few requests may hold the K/V of many long windows, and one
whose windows wait for blocks is full whatever its queue says. Each decoder replica reports its
pool (``record_routing_stats``, every ``routing_stats_period_s``); this router ranks replicas by
the free blocks they will have once the windows already queued there are admitted.

Reports are up to a period old, so a burst would all go to whichever replica looked emptiest at
the last report. The router therefore counts the windows it has sent to each replica since that
replica's last report and subtracts their reservations from the reported figure (Ray Serve LLM's
prefix-aware router guards against the same herding with an imbalance threshold).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

DECODE_METHOD = "decode"  # the only call that takes blocks; check_options and stats take none


@dataclass(frozen=True)
class KVRoutingStats:
    """What a decoder replica reports to the router (as a dict: Serve's routing-stats format)."""

    report_id: int  # increases with every report, so the router knows a fresh one
    num_total_blocks: int
    num_free_blocks: int
    waiting_blocks: int  # worst-case reservations of windows queued in the replica, not yet admitted
    blocks_per_window: int  # a typical window's reservation: what one more routed window will take

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, stats: dict[str, Any] | None) -> "KVRoutingStats | None":
        try:
            return cls(**{name: int(stats[name]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError):
            return None  # not reported yet (a replica just started)


NOT_REPORTED = -1  # the report id of a replica that has not reported yet


class MostFreeKVBlocksRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        # replica -> (the report id the count is relative to, windows sent since that report)
        self._sent_since_report: dict[ReplicaID, tuple[int, int]] = {}

    def _windows_sent_since(self, replica_id: ReplicaID, report_id: int) -> int:
        counted_since, sent = self._sent_since_report.get(replica_id, (report_id, 0))
        # A newer report than the count's already has those windows in its figures.
        return sent if counted_since == report_id else 0

    def expected_free_blocks(
        self, replica: RunningReplica, reports: dict[ReplicaID, KVRoutingStats]
    ) -> float:
        stats = reports.get(replica.replica_id)
        if stats is not None:
            sent = self._windows_sent_since(replica.replica_id, stats.report_id)
            return stats.num_free_blocks - stats.waiting_blocks - sent * stats.blocks_per_window
        # Not reported yet (just started): its pool is empty; take the size of the others' pools, so
        # a burst spreads over new replicas by windows sent instead of all going to the first one.
        pool_blocks = max((s.num_total_blocks for s in reports.values()), default=0)
        window_blocks = max((s.blocks_per_window for s in reports.values()), default=1)
        return pool_blocks - self._windows_sent_since(replica.replica_id, NOT_REPORTED) * window_blocks

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        reports = {
            r.replica_id: stats
            for r in candidate_replicas
            if (stats := KVRoutingStats.from_dict(r.routing_stats)) is not None
        }
        # Shuffle first so that ties (e.g. idle replicas) are broken at random, not by list order.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        ranked = sorted(
            shuffled, key=lambda replica: self.expected_free_blocks(replica, reports), reverse=True
        )
        # One replica per rank: Serve tries them in order and skips one whose queue is full.
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if pending_request.metadata.call_method != DECODE_METHOD:
            return
        replica = self._replicas.get(replica_id)
        stats = KVRoutingStats.from_dict(replica.routing_stats) if replica is not None else None
        report_id = stats.report_id if stats is not None else NOT_REPORTED
        self._sent_since_report[replica_id] = (report_id, self._windows_sent_since(replica_id, report_id) + 1)
