"""The app's own request routers: decoder windows by free KV blocks, live sessions by room.

**Decoders.** Serve's default router picks the shorter queue of two random replicas. For decoders
the queue length says little: a replica with few requests may hold the K/V of many long windows,
and one whose windows wait for blocks is full whatever its queue says. Each decoder replica reports
its pool (``record_routing_stats``, every ``routing_stats_period_s``); ``MostFreeKVBlocksRouter``
ranks replicas by the free blocks they will have once the windows already queued there are admitted.

Reports are up to a period old, so a burst would all go to whichever replica looked emptiest at
the last report. The router therefore counts the windows it has sent to each replica since that
replica's last report and subtracts their reservations from the reported figure (Ray Serve LLM's
prefix-aware router guards against the same herding with an imbalance threshold).

**Ingress.** Serve's default router prefers the replica on the proxy's own node: on a cluster each
node's proxy fills its own ingress replica up to `realtime.max_sessions`, which then closes new
sessions with 1013 while the others have room. ``SessionRoomRouter`` ranks every replica alike,
wherever it runs: those with session room at their last report first, the full ones after. Within
a rank Serve takes the replica with the fewest ongoing requests, a count it keeps live, and a
session is one for as long as it is open: sessions spread evenly, and one reaches a full replica
(its 1013) only when every replica is full (or, between two reports, when the replicas with room
are busier with HTTP requests than the full one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

DECODE_METHOD = "decode"  # the only call that takes blocks; check_options and stats take none


class RoutingReport:
    """A replica's report to its router, carried by Serve as a dict of ints (routing stats)."""

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, stats: dict[str, Any] | None):
        """The report, or None where the replica has not reported yet (it just started)."""
        try:
            return cls(**{name: int(stats[name]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class KVRoutingStats(RoutingReport):
    """What a decoder replica reports to the router."""

    report_id: int  # increases with every report, so the router knows a fresh one
    num_total_blocks: int
    num_free_blocks: int
    waiting_blocks: int  # worst-case reservations of windows queued in the replica, not yet admitted
    blocks_per_window: int  # a typical window's reservation: what one more routed window will take


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


@dataclass(frozen=True)
class SessionRoutingStats(RoutingReport):
    """What an ingress replica reports to the router."""

    open_sessions: int
    max_sessions: int  # realtime.max_sessions: beyond it the replica closes a new session with 1013


class SessionRoomRouter(FIFOMixin, RequestRouter):
    def has_room(self, replica: RunningReplica) -> bool:
        stats = SessionRoutingStats.from_dict(replica.routing_stats)
        return stats is None or stats.open_sessions < stats.max_sessions  # None: just started, empty

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Not adjusted by the calls sent since a report, as the decoders' router is: a call may be
        # a session or an HTTP request (both are ASGI calls here), and a report on its way when a
        # call was sent would drop that call from the count. Serve's live count of ongoing
        # requests, within the rank, spreads a burst instead.
        with_room = [replica for replica in candidate_replicas if self.has_room(replica)]
        full = [replica for replica in candidate_replicas if not self.has_room(replica)]
        # Serve tries the next rank only if every replica of this one is at max_ongoing_requests.
        return [rank for rank in (with_room, full) if rank]
