"""The real app on a local Ray, for the tests that talk to it over HTTP: one place that starts Ray
and Serve, runs the app and stops it. Serve stays up between apps (own_ray stops it with Ray)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from tests.support.app_metrics import metric_sum
from tests.support.local_ray import before_stopping, local_ray, own_ray
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


# tests/deployments/test_hostile_input.py's and test_realtime.py's app, which the two share (they
# run back to back, tests/conftest.py's SHARED_APP_MODULES): API keys on, one for each module.
HOSTILE_API_KEY = "hostile-test-key"
REALTIME_API_KEY = "realtime-test-key"
# A decoded-audio bound small enough for a test to fill: the shipped one is four hours.
KEYED_MAX_AUDIO_S = 3600
KEYED_MAX_DECODED_AUDIO_S = 2 * KEYED_MAX_AUDIO_S  # two of the longest files at once
KEYED_DECODE_PROCESSES = 2
# Short: a bomb that finds no room, or no idle decoding process, is answered 503 within it.
KEYED_DECODED_AUDIO_WAIT_S = 3
KEYED_MAX_SESSIONS = 10  # live sessions: few enough for a test to open one past the limit


def keyed_app_args() -> dict[str, Any]:
    """The default one-model app with test_hostile_input.py's and test_realtime.py's settings."""
    args = default_app_args()
    http = {
        **args["http"],
        "api_keys": [HOSTILE_API_KEY, REALTIME_API_KEY],
        "max_audio_duration_s": KEYED_MAX_AUDIO_S,
        "max_decoded_audio_s": KEYED_MAX_DECODED_AUDIO_S,
        "decoded_audio_wait_s": KEYED_DECODED_AUDIO_WAIT_S,
        "decode_processes": KEYED_DECODE_PROCESSES,
    }
    return {**args, "http": http, "realtime": {"max_sessions": KEYED_MAX_SESSIONS, "idle_timeout_s": 60}}


@dataclass
class _Serve:
    """Serve on the run's local Ray, kept up between apps: the next module's app starts without
    waiting for a controller and a proxy to start again. At most one app runs on it at a time."""

    port: int
    app_args: str | None = None  # the running app's args, as JSON; None: no app
    shared: bool = False  # the app was started to be shared: left running for the next module

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


_serve: _Serve | None = None


@contextlib.contextmanager
def running_app(args: dict[str, Any], fresh_ray: bool = False, shared: bool = False) -> Iterator[str]:
    """Run the app built from ``args`` at ``/`` on the run's local Ray (local_ray) and yield its
    base URL; stop it after. With ``fresh_ray``, on a Ray started for this app alone and stopped
    with it: one whose processes must inherit the environment the caller has just set.

    With ``shared``, the app is left running after, for the next module that asks for a shared app
    of the same ``args`` (tests/conftest.py runs such modules back to back): for modules whose tests
    need no fresh app, only these settings. Any other app, or stopping the local Ray, stops it."""
    global _serve
    from ray import serve

    from deployments.app import build_app

    if fresh_ray:
        own_ray()
    local_ray()
    key = json.dumps(args, sort_keys=True)
    if shared and _serve is not None and _serve.shared and _serve.app_args == key:
        yield _serve.url
        return
    _stop_app()
    if _serve is None:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _serve = _Serve(port)
        before_stopping(_stop_serve)
    started = False
    try:
        _serve.app_args, _serve.shared = key, shared
        serve.run(build_app(args), name="whisper", route_prefix="/")
        started = True
        yield _serve.url
    finally:
        if not (shared and started):
            _stop_app()
        if fresh_ray:
            own_ray()


def _stop_app() -> None:
    """Delete the app running on the run's Serve, if one is, and wait for its processes to exit."""
    from ray import serve

    if _serve is None or _serve.app_args is None:
        return
    try:
        serve.delete("whisper")
    finally:
        _serve.app_args = None
        _wait_for_replica_processes_to_exit()


def _stop_serve() -> None:
    """Stop the app and Serve on the run's local Ray (own_ray calls this before stopping Ray)."""
    global _serve
    from ray import serve

    if _serve is None:
        return
    try:
        _stop_app()
        serve.shutdown()
    finally:
        _serve = None


def _wait_for_replica_processes_to_exit(timeout_s: float = 30.0) -> None:
    """Deleting an app returns once the replicas' actors are stopped; their processes (and their
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
