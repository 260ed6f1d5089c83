"""The app's routers (deployments/routing.py): windows go to the decoder replica with the most free
KV blocks, counting the windows it has sent since each replica's last report; live sessions go to
an ingress replica with room.

The replicas are Ray Serve's own in-memory stand-in for request-router tests, carrying the
routing stats a DecoderDeployment or an Ingress reports; the routers are the real ones, as Serve
drives them (``choose_replicas`` then ``on_request_routed`` per call). The served app routes
windows through them in tests/deployments/test_autoscaling.py, sessions in
tests/deployments/test_session_spread.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve._private.test_utils import FakeRunningReplica

from deployments.routing import KVRoutingStats, MostFreeKVBlocksRouter, SessionRoomRouter, SessionRoutingStats

POOL_BLOCKS = 1000
WINDOW_BLOCKS = 122  # tiny.en with 16-token blocks: 94 cross-attention blocks + 28 text blocks


class ReportingReplica(FakeRunningReplica):
    def __init__(self, name: str):
        super().__init__(name)
        self.report: KVRoutingStats | None = None

    def reports(self, report_id: int, free_blocks: int, waiting_windows: int = 0) -> None:
        self.report = KVRoutingStats(
            report_id, POOL_BLOCKS, free_blocks, waiting_windows * WINDOW_BLOCKS, WINDOW_BLOCKS
        )

    @property
    def routing_stats(self) -> dict:
        return self.report.as_dict() if self.report else {}


def _route(router: MostFreeKVBlocksRouter, replicas: list[ReportingReplica], windows: int) -> list[str]:
    """Route ``windows`` decode calls the way Serve does; the replica names chosen, in order."""
    chosen = []
    for _ in range(windows):
        ranks = asyncio.run(router.choose_replicas(replicas))
        replica = ranks[0][0]
        request = SimpleNamespace(metadata=SimpleNamespace(call_method="decode"))
        router.on_request_routed(request, replica.replica_id, result=None)
        chosen.append(replica.replica_id.unique_id)
    return chosen


def _router(replicas: list[FakeRunningReplica], router_class: type = MostFreeKVBlocksRouter):
    router = router_class(
        deployment_id=DeploymentID(name="WhisperDecoder"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    router.initialize_state()
    router._replicas = {replica.replica_id: replica for replica in replicas}  # what update_replicas keeps
    return router


def test_with_one_decoder_nearly_full_new_windows_go_to_the_other():
    full, roomy = ReportingReplica("nearly-full"), ReportingReplica("roomy")
    full.reports(report_id=7, free_blocks=130)  # room for one more window
    roomy.reports(report_id=3, free_blocks=900)
    router = _router([full, roomy])
    # The roomy replica takes windows until its expected free blocks fall to the full one's.
    assert _route(router, [full, roomy], 6) == ["roomy"] * 6


def test_windows_waiting_inside_a_replica_count_against_its_free_blocks():
    queued, idle = ReportingReplica("queued"), ReportingReplica("idle")
    queued.reports(report_id=1, free_blocks=POOL_BLOCKS, waiting_windows=5)  # free now, but five windows wait
    idle.reports(report_id=1, free_blocks=700)
    assert _route(_router([queued, idle]), [queued, idle], 1) == ["idle"]


def test_a_burst_between_reports_spreads_instead_of_piling_onto_the_last_emptiest_replica():
    a, b = ReportingReplica("a"), ReportingReplica("b")
    a.reports(report_id=1, free_blocks=POOL_BLOCKS)
    b.reports(report_id=1, free_blocks=POOL_BLOCKS - WINDOW_BLOCKS)
    router = _router([a, b])
    chosen = _route(router, [a, b], 7)
    assert chosen[0] == "a" and abs(chosen.count("a") - chosen.count("b")) <= 1, chosen
    # A fresh report already holds the windows sent before it: the count starts again from it.
    a.reports(report_id=2, free_blocks=POOL_BLOCKS - 4 * WINDOW_BLOCKS)
    b.reports(report_id=2, free_blocks=POOL_BLOCKS - 1 * WINDOW_BLOCKS)
    assert _route(router, [a, b], 3) == ["b", "b", "b"]


def test_a_replica_that_has_not_reported_yet_counts_as_empty_and_shares_a_burst():
    busy, new = ReportingReplica("busy"), ReportingReplica("new")
    busy.reports(report_id=9, free_blocks=2 * WINDOW_BLOCKS)
    router = _router([busy, new])
    chosen = _route(router, [busy, new], 10)
    assert chosen[:6] == ["new"] * 6 and "busy" in chosen, chosen


MAX_SESSIONS = 4


class IngressReplica(FakeRunningReplica):
    def __init__(self, name: str, node_id: str = ""):
        super().__init__(name, node_id=node_id)
        self.report: SessionRoutingStats | None = None

    def reports(self, open_sessions: int) -> None:
        self.report = SessionRoutingStats(open_sessions, MAX_SESSIONS)

    @property
    def routing_stats(self) -> dict:
        return self.report.as_dict() if self.report else {}


def _ranks(replicas: list[IngressReplica]) -> list[set[str]]:
    router = _router(replicas, SessionRoomRouter)
    return [{r.replica_id.unique_id for r in rank} for rank in asyncio.run(router.choose_replicas(replicas))]


def test_ingress_replicas_with_session_room_share_the_first_rank_wherever_they_run():
    """One rank: Serve then takes the replica with the fewest ongoing requests (an open session is
    one), not the one on the proxy's own node."""
    local, remote = IngressReplica("local", node_id="head"), IngressReplica("remote", node_id="worker")
    local.reports(open_sessions=1)
    remote.reports(open_sessions=0)
    assert _ranks([local, remote]) == [{"local", "remote"}]


def test_a_full_ingress_replica_is_tried_only_after_those_with_room():
    full, roomy, new = IngressReplica("full"), IngressReplica("roomy"), IngressReplica("new")
    full.reports(open_sessions=MAX_SESSIONS)
    roomy.reports(open_sessions=MAX_SESSIONS - 1)  # new: not reported yet, so empty
    assert _ranks([full, roomy, new]) == [{"roomy", "new"}, {"full"}]


def test_when_every_ingress_replica_is_full_they_share_one_rank():
    a, b = IngressReplica("a"), IngressReplica("b")
    a.reports(open_sessions=MAX_SESSIONS)
    b.reports(open_sessions=MAX_SESSIONS)
    assert _ranks([a, b]) == [{"a", "b"}]
