"""The autoscaling scenario on a local multi-node Ray cluster (CPU): encoders and decoders scale on
their own. tests/deployments/test_autoscaling.py runs it with short phases;
benchmarks/bench_autoscaling.py with longer ones, its plot and its record.

Starts a Ray cluster of three raylets on this machine (ray.cluster_utils.Cluster): a head node
for the ingress, an encoder node and a decoder node, each declaring a custom resource that the
deployments' `resources` ask for, so replicas land only on their node type. Then, with the replica
counts sampled every second:

1. encoder burst: clients send 2 s clips of near silence back to back. Every clip is one full
   window for the encoder and a few tokens for the decoder: encoders should scale up, decoders stay.
2. idle until both sides are back to one replica.
3. decoder load: clients send ~85 s files of dense speech (three windows of ~90 tokens each).
   The decoders (max_num_seqs 2) fall behind: decoders should scale up.
4. idle until both sides are back to one replica.

Every request must come back 200 (none lost while replicas come and go). The knobs that make one
side the bottleneck on 2 cores are in ``scenario_config`` (small encoder batches, two decoding
sequences per decoder); nothing in the app sleeps.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from engine.model.audio import SAMPLE_RATE
from tests.support.local_ray import own_ray
from tests.support.ports import free_port
from tests.support.speech import dense_speech_file, wav_bytes

APP_NAME = "whisper"
ENCODER, DECODER = "WhisperEncoder", "WhisperDecoder"
NODE_RESOURCE = {
    "ingress": "whisper_ingress_node",
    ENCODER: "whisper_encoder_node",
    DECODER: "whisper_decoder_node",
}
MAX_REPLICAS = 3


def scenario_config(upscale_delay_s: float = 2.0, downscale_delay_s: float = 6.0) -> dict:
    """The app's args for the scenario: short autoscaling delays so a run takes minutes."""
    scaling = {
        "min_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 3.0,
    }
    return {
        "engine": {"model": "tiny.en", "device": "cpu", "max_num_seqs": 2, "kv_cache_memory_mb": 300},
        # The object store works between raylets with no further setup; NIXL would need UCX networking.
        "transfer": {"connector": "object_store", "staging_memory_mb": 256},
        "encoder": {
            "num_cpus": 0.5,
            "torch_threads": 1,
            "max_batch_size": 2,
            "target_pending_windows": 6,
            "resources": {NODE_RESOURCE[ENCODER]: 1},
            "autoscaling": scaling,
            "drain_timeout_s": 60,
        },
        "decoder": {
            "num_cpus": 0.5,
            "torch_threads": 1,
            "target_kv_utilization": 0.5,
            "routing_stats_period_s": 0.5,
            "resources": {NODE_RESOURCE[DECODER]: 1},
            "autoscaling": scaling,
            "drain_timeout_s": 60,
        },
        "ingress": {
            "num_cpus": 0.25,
            "max_ongoing_requests": 1024,
            "resources": {NODE_RESOURCE["ingress"]: 1},
        },
        # Every clip decoded whole, windows cut at quiet points: with speech detection (the shipped
        # default) the burst's near-silent clips would never reach an encoder.
        "http": {"vad_by_default": False},
    }


def start_cluster():
    """Head (ingress, Serve's controller and proxy) + one encoder node + one decoder node."""
    own_ray()
    # Handles report queued requests to the autoscaler every 10 s by default; the scenario is short.
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {NODE_RESOURCE["ingress"]: 2},
            "include_dashboard": False,
        },
    )
    for deployment in (ENCODER, DECODER):
        cluster.add_node(num_cpus=2, resources={NODE_RESOURCE[deployment]: MAX_REPLICAS})
    cluster.wait_for_nodes()
    return cluster


def start_app(cluster, args: dict) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def running_replicas() -> dict[str, int]:
    from ray import serve

    deployments = serve.status().applications[APP_NAME].deployments
    return {name: deployments[name].replica_states.get("RUNNING", 0) for name in (ENCODER, DECODER)}


def replica_nodes() -> dict[str, set[str]]:
    """Deployment -> the custom resources of the nodes its live replicas run on (each replica
    reports its node id in its stats)."""
    import ray
    from ray import serve

    node_resources = {node["NodeID"]: set(node["Resources"]) for node in ray.nodes() if node["Alive"]}
    placed: dict[str, set[str]] = {}
    for name in (ENCODER, DECODER):
        stats = serve.get_deployment_handle(name, APP_NAME).broadcast("stats").results(timeout_s=30)
        for replica_stats in stats:
            placed.setdefault(name, set()).update(
                r for r in node_resources.get(replica_stats.node_id, ()) if r.startswith("whisper_")
            )
    return placed


def near_silent_clip(seed: int) -> bytes:
    """2 s of faint noise: a full encoder window, almost nothing to decode."""
    return wav_bytes(np.random.default_rng(seed).normal(0, 1e-4, 2 * SAMPLE_RATE).astype(np.float32))


@dataclass
class Timeline:
    """Replica counts sampled every second, with the phase each sample fell in."""

    started: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, str, int, int]] = field(
        default_factory=list
    )  # (t_s, phase, encoders, decoders)
    phase: str = "start"

    def sample(self) -> dict[str, int]:
        counts = running_replicas()
        if not self.samples or self.samples[-1][2:] != (counts[ENCODER], counts[DECODER]):
            print(f"{time.monotonic() - self.started:6.1f} s  {self.phase}: {counts}", flush=True)
        self.samples.append((time.monotonic() - self.started, self.phase, counts[ENCODER], counts[DECODER]))
        return counts

    def max_of(self, phase: str, column: int) -> int:
        return max((s[column] for s in self.samples if s[1] == phase), default=0)


@dataclass
class LoadOutcome:
    sent: int = 0
    ok: int = 0
    lost: list[str] = field(default_factory=list)  # no answer, or an answer other than 200


def run_clients(
    url: str,
    payloads: list[bytes],
    clients: int,
    duration_s: float,
    outcome: LoadOutcome,
    timeline: Timeline,
    stagger_s: float = 0.0,
) -> None:
    """``clients`` threads, the i-th starting i * ``stagger_s`` in, send ``payloads`` back to back
    until ``duration_s``; replicas are sampled meanwhile."""
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def client(index: int) -> None:
        time.sleep(index * stagger_s)
        with httpx.Client(timeout=600) as http:
            sent = 0
            while time.monotonic() < stop_at:
                data = payloads[(index + sent) % len(payloads)]
                sent += 1
                with lock:
                    outcome.sent += 1
                try:
                    response = http.post(
                        f"{url}/v1/audio/transcriptions",
                        files={"file": ("audio.wav", data)},
                        data={"model": "tiny.en"},
                    )
                    failure = (
                        None
                        if response.status_code == 200
                        else f"HTTP {response.status_code}: {response.text[:200]}"
                    )
                except httpx.HTTPError as error:
                    failure = f"{type(error).__name__}: {error}"
                with lock:
                    if failure is None:
                        outcome.ok += 1
                    else:
                        outcome.lost.append(failure)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        timeline.sample()
        time.sleep(1)


def wait_for_one_replica_each(timeline: Timeline, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = timeline.sample()
        if counts[ENCODER] == 1 and counts[DECODER] == 1:
            return True
        time.sleep(1)
    return False


@dataclass
class ScenarioResult:
    timeline: Timeline
    outcome: LoadOutcome
    returned_to_one_after_burst: bool
    returned_to_one_after_load: bool
    placement: dict[str, set[str]]

    def metrics(self) -> dict:
        return {
            "encoder_replicas_max_encoder_burst": self.timeline.max_of("encoder burst", 2),
            "decoder_replicas_max_encoder_burst": self.timeline.max_of("encoder burst", 3),
            "encoder_replicas_max_decoder_load": self.timeline.max_of("decoder load", 2),
            "decoder_replicas_max_decoder_load": self.timeline.max_of("decoder load", 3),
            "lost_requests": len(self.outcome.lost),
            "requests": self.outcome.sent,
            "back_to_one_replica_each_after_idle": self.returned_to_one_after_burst
            and self.returned_to_one_after_load,
        }


def run_scenario(
    url: str,
    burst_s: float,
    load_s: float,
    burst_clients: int = 16,
    load_clients: int = 5,
    idle_timeout_s: float = 90,
) -> ScenarioResult:
    timeline, outcome = Timeline(), LoadOutcome()
    silent = [near_silent_clip(seed) for seed in range(8)]
    dense = [dense_speech_file()]
    timeline.phase = "encoder burst"
    run_clients(url, silent, burst_clients, burst_s, outcome, timeline)
    timeline.phase = "idle"
    back_after_burst = wait_for_one_replica_each(timeline, idle_timeout_s)
    placement_during_run = replica_nodes()
    timeline.phase = "decoder load"
    # Long files arrive spread out, as jobs do, rather than all in the same second: a wave of
    # 3-window files at once would be an encoder burst of its own.
    run_clients(url, dense, load_clients, load_s, outcome, timeline, stagger_s=load_s / (2 * load_clients))
    for name, resources in replica_nodes().items():
        placement_during_run.setdefault(name, set()).update(resources)
    timeline.phase = "idle after load"
    back_after_load = wait_for_one_replica_each(timeline, idle_timeout_s)
    return ScenarioResult(timeline, outcome, back_after_burst, back_after_load, placement_during_run)
