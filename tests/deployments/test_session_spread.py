"""Live sessions spread over the ingress replicas by room (deployments/routing.py, SessionRoomRouter).

A Ray cluster of two raylets on this machine (ray.cluster_utils.Cluster), one ingress replica on
each, and Serve's proxy on the head only, as configs/default.yaml has it: the proxy's own router
would prefer the replica on its node and fill it while the other stands empty. Sessions are opened
with the official `openai` client's realtime connection, and each replica's open sessions read
from what it reports to the router.
"""

from __future__ import annotations

import contextlib
import json
import time

import openai
import pytest
import websockets

from tests.support.local_ray import own_ray
from tests.support.ports import free_port
from tests.support.serving import default_app_args

pytestmark = pytest.mark.ray

INGRESS_NODE = "whisper_ingress_node"  # one a raylet, one an ingress replica: a replica on each
MAX_SESSIONS = 8  # per ingress replica
SESSIONS = 8  # opened at once in the split test: half the app's room
STATS_PERIOD_S = 0.5


@pytest.fixture(scope="module")
def server_url():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app

    own_ray()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {INGRESS_NODE: 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={INGRESS_NODE: 1})
    cluster.wait_for_nodes()
    args = default_app_args()
    args.pop("diarizer", None)
    args |= {
        "placement": "colocated",  # the decoder encodes too: one model replica to start, no transfer
        "ingress": {**args["ingress"], "num_replicas": 2, "resources": {INGRESS_NODE: 1}},
        "realtime": {"max_sessions": MAX_SESSIONS, "routing_stats_period_s": STATS_PERIOD_S},
    }
    port = free_port()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="whisper", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _open_sessions_per_replica() -> list[int]:
    """Each ingress replica's open sessions, as it reports them to the router."""
    import ray

    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if "#WhisperIngress#" in actor["name"]
    ]
    replicas = [ray.get_actor(name, namespace="serve") for name in names]
    reports = ray.get([replica.record_routing_stats.remote() for replica in replicas], timeout=30)
    return sorted(report["open_sessions"] for report in reports)


def _first_event(connection) -> dict:
    return json.loads(connection.recv_bytes())


@contextlib.contextmanager
def _sessions(client: openai.OpenAI, count: int):
    """``count`` sessions opened one after another, each answered with session.created."""
    with contextlib.ExitStack() as stack:
        connections = []
        for _ in range(count):
            connection = stack.enter_context(client.realtime.connect(extra_query={"intent": "transcription"}))
            event = _first_event(connection)
            assert event["type"] == "session.created", f"session {len(connections) + 1}: {event}"
            connections.append(connection)
        yield connections


def _wait_until_no_sessions(within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(_open_sessions_per_replica()):
        assert time.monotonic() < deadline, "earlier sessions are still open"
        time.sleep(0.2)


def test_with_two_ingress_replicas_sessions_split_between_them_within_one_of_even(client):
    _wait_until_no_sessions()
    with _sessions(client, SESSIONS):
        held = _open_sessions_per_replica()
        assert len(held) == 2 and sum(held) == SESSIONS, held
        assert all(abs(count - SESSIONS / 2) <= 1 for count in held), held


def test_a_session_is_refused_with_1013_only_once_every_replica_is_full(client):
    _wait_until_no_sessions()
    # Every replica's room, taken: each session beyond one replica's room must find the other.
    with _sessions(client, 2 * MAX_SESSIONS):
        assert _open_sessions_per_replica() == [MAX_SESSIONS] * 2
        with client.realtime.connect(extra_query={"intent": "transcription"}) as extra:
            refusal = _first_event(extra)
            assert refusal["type"] == "error" and refusal["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                extra.recv_bytes()
            assert closed.value.rcvd.code == 1013
