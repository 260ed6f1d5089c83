"""The real app on a local Ray, for the tests that talk to it over HTTP: one place that starts Ray
and Serve, runs the app and shuts both down."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from tests.support.app_metrics import metric_sum
from tests.support.local_ray import local_ray, own_ray
from tests.support.paths import CONFIGS_DIR
from tests.support.ports import free_port
from tests.support.speech import english_clips


def shipped_default_args() -> dict[str, Any]:
    """The args of `make serve`'s app (configs/default.yaml) as shipped: its models and all."""
    return yaml.safe_load((CONFIGS_DIR / "default.yaml").read_text())["applications"][0]["args"]


def default_app_args() -> dict[str, Any]:
    """A one-model app of `make serve`'s default model (tiny.en): configs/default.yaml's app with
    only that model, in the one-model shape (`engine`, `encoder`, ... at the top), for a test to
    override. Tests of other things start one model: each model costs the app's start-up time."""
    args = shipped_default_args()
    models = args.pop("models", None)
    if not models:
        return args
    model = next((model for model in models if model.get("default")), models[0])
    names = [model.get("name") or model["engine"]["model"], *model.get("aliases", [])]
    sections = ("placement", "engine", "transfer", "encoder", "decoder")
    return {"served_model_names": names, **{name: model[name] for name in sections if name in model}, **args}


@contextlib.contextmanager
def running_app(args: dict[str, Any], fresh_ray: bool = False) -> Iterator[str]:
    """Run the app built from ``args`` at ``/`` on the run's local Ray (local_ray) and yield its
    base URL; shut Serve down after. With ``fresh_ray``, on a Ray started for this app alone and
    stopped with it: one whose processes must inherit the environment the caller has just set."""
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    if fresh_ray:
        own_ray()
    local_ray()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="whisper", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        _wait_for_replica_processes_to_exit()
        if fresh_ray:
            ray.shutdown()


def _wait_for_replica_processes_to_exit(timeout_s: float = 30.0) -> None:
    """Serve's shutdown returns once the replicas' actors are stopped; their processes (and their
    engines' children) may take a moment more to exit. The next app's tests find their replicas'
    processes by name, so none of this app's may linger. (The local Ray's processes descend from
    this one, which started it.)"""
    import psutil

    processes = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "ServeReplica:whisper:" in " ".join(process.cmdline()):
                processes += [process, *process.children(recursive=True)]
    lingering = psutil.wait_procs(processes, timeout=timeout_s)[1]
    assert not lingering, f"replica processes still running after Serve's shutdown: {lingering}"


def replica_actor(deployment: str):
    """The one replica actor of ``deployment`` (e.g. "WhisperDecoder") in the running app, for a
    fault test to kill (Serve replaces it)."""
    import ray

    names = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def hang_up_once_decoding(server_url: str, headers: dict[str, str], clip: Path) -> None:
    """Send a transcription request for ``clip`` over a raw socket and close the connection as soon
    as a decoder runs a window: a client that goes away mid-decode."""
    url = httpx.URL(f"{server_url}/v1/audio/transcriptions")
    request = httpx.Request(
        "POST",
        url,
        headers=headers,
        data={"model": "whisper-1"},
        files={"file": (clip.name, clip.read_bytes())},
    )
    head = f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
    head += "".join(
        f"{name}: {value}\r\n" for name, value in request.headers.items() if name.lower() != "host"
    )
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall(head.encode() + b"\r\n" + request.read())
        deadline = time.monotonic() + 60
        while metric_sum(server_url, "whisper_decoder_running", headers) == 0:  # its windows are decoding now
            assert time.monotonic() < deadline, "the request never reached the decoder"
            time.sleep(0.05)


def engine_process(deployment: str = "WhisperDecoder"):
    """The engine's own process (deployments/engine_process.py) under the one replica of
    ``deployment``, found by the replica's process title, which Ray sets."""
    import psutil

    replicas = [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"ServeReplica:whisper:{deployment}" in " ".join(p.info["cmdline"] or [])
    ]
    assert len(replicas) == 1, replicas
    engines = [
        child
        for child in replicas[0].children()
        if "spawn_main" in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(child.cmdline())
    ]
    assert len(engines) == 1, engines
    return engines[0]


def statuses_with_a_replica_killed(
    client: openai.OpenAI, deployment: str, engine_process_only: bool = False
) -> list[int]:
    """Thirteen requests at once (one of them two windows long), and one replica of ``deployment``
    killed while they run (Serve replaces it), or with ``engine_process_only`` only its engine's
    process (the replica's health check then fails and Serve replaces it): each request's HTTP status."""
    import ray

    clips = [c for c in english_clips() if c.duration_s <= 30][:12] + [
        c for c in english_clips() if c.duration_s > 30
    ]

    def attempt(clip) -> int:
        try:
            with open(clip.path, "rb") as audio:
                client.audio.transcriptions.create(model="whisper-1", file=audio)
            return 200
        except openai.APIStatusError as error:
            assert error.response.json()["error"]["message"]
            return error.status_code

    with ThreadPoolExecutor(len(clips)) as pool:
        statuses = pool.map(attempt, clips)
        time.sleep(1.0)  # requests are in the encoder's batches and the decoder's loop now
        if engine_process_only:
            engine_process(deployment).kill()
        else:
            ray.kill(replica_actor(deployment), no_restart=True)
        return list(statuses)
