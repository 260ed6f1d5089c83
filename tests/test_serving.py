"""The default app (configs/default.yaml) on a real local Ray and Serve, spoken to over HTTP with
the official openai client: same text as the offline API, 32 concurrent requests, formats, errors."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from engine.offline import Transcriber
from tests.conftest import SPEECH_DIR, english_clips

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
API_KEY = "test-key-123"  # the default app, with API keys switched on to test them too
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    import ray
    from ray import serve

    from deployments.app import build_app

    app_spec = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]
    port = _free_port()
    # As `serve run` does: Ray sees this machine's cores, and the default app must fit in them.
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {**app_spec["args"], "http": {**app_spec["args"].get("http", {}), "api_keys": [API_KEY]}}
    serve.run(build_app(args), name=app_spec["name"], route_prefix=app_spec["route_prefix"])
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline_texts(tiny_en) -> dict[str, str]:
    clips = english_clips()
    transcriptions = Transcriber(loaded=tiny_en).transcribe([clip.path for clip in clips])
    return {clip.id: result.text for clip, result in zip(clips, transcriptions)}


def _transcribe(client: openai.OpenAI, path: Path, **kwargs):
    with open(path, "rb") as audio:
        return client.audio.transcriptions.create(model="whisper-1", file=audio, **kwargs)


def _kv_blocks_used(server_url: str) -> float:
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("whisper_decoder_kv_blocks_used{")]
    assert values, "the decoder replica reported no KV figures"
    return sum(values)


def test_the_openai_client_gets_the_offline_apis_text_for_speech_set_clips(client, offline_texts):
    clip_ids = ["jfk", "osr72_01", "tts_05", "tts_18", "osr_list72"]  # osr_list72: 35 s, two windows
    for clip_id in clip_ids:
        clip = next(c for c in english_clips() if c.id == clip_id)
        assert _transcribe(client, clip.path).text == offline_texts[clip_id], clip_id


def test_thirty_two_concurrent_requests_each_match_their_single_request_text_and_free_all_blocks(
    client, server_url, offline_texts
):
    clips = [clip for clip in english_clips() if clip.duration_s <= 30][:32]
    assert len(clips) == 32
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(lambda clip: _transcribe(client, clip.path).text, clips))
    assert texts == [offline_texts[clip.id] for clip in clips]
    assert _kv_blocks_used(server_url) == 0


def test_text_srt_vtt_and_verbose_json_formats(client, offline_texts):
    path = SPEECH_DIR / "osr_list72.flac"  # two windows, so two segments
    expected = offline_texts["osr_list72"]
    assert _transcribe(client, path, response_format="text").strip() == expected
    srt = _transcribe(client, path, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:30,000\n") and "\n2\n00:00:30,000 --> 00:00:35," in srt
    vtt = _transcribe(client, path, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:30.000\n")
    verbose = _transcribe(client, path, response_format="verbose_json")
    assert verbose.text == expected and verbose.language == "en" and abs(verbose.duration - 35.55) < 0.01
    assert [(s.start, s.end) for s in verbose.segments] == [(0.0, 30.0), (30.0, pytest.approx(35.55, abs=0.01))]


def test_the_default_app_moves_cross_attention_kv_over_nixl(client, server_url):
    _transcribe(client, SPEECH_DIR / "osr72_02.flac")
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    assert 'whisper_transfer_info{connector="nixl",payload="cross_kv",replica="0"} 1.0' in metrics
    staged = [line for line in metrics.splitlines() if line.startswith("whisper_encoder_staged{")]
    assert staged and float(staged[0].split()[-1]) == 0, "every staged window was pulled and released"


def test_models_and_health_routes(server_url):
    models = httpx.get(f"{server_url}/v1/models", headers=AUTH, timeout=30).json()
    assert {m["id"] for m in models["data"]} >= {"whisper-1", "tiny.en"}
    assert httpx.get(f"{server_url}/health", timeout=30).json() == {"status": "ok"}


@pytest.mark.parametrize(
    "files, data, status, param",
    [
        ({"file": ("notes.wav", b"meeting notes, not audio" * 10, "audio/wav")}, {"model": "whisper-1"}, 400, "file"),
        ({"file": ("empty.wav", b"", "audio/wav")}, {"model": "whisper-1"}, 400, "file"),
        (None, {"model": "whisper-1"}, 400, "file"),
        ({"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")}, {"model": "/etc/passwd"}, 404, "model"),
        ({"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")},
         {"model": "whisper-1", "response_format": "docx"}, 400, "response_format"),
        ({"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")},
         {"model": "whisper-1", "temperature": "7"}, 400, "temperature"),
    ],
    ids=["not-audio", "empty-file", "missing-file", "unknown-model", "bad-format", "bad-temperature"],
)
def test_bad_requests_get_openai_error_json_and_the_server_keeps_serving(client, server_url, files, data, status, param):
    url = f"{server_url}/v1/audio/transcriptions"
    response = httpx.post(url, files=files or {"other": ("x", b"x")}, data=data, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert "ask not what your country" in _transcribe(client, SPEECH_DIR / "jfk.flac").text


def test_translation_on_an_english_only_model_is_a_clear_400(server_url):
    response = httpx.post(
        f"{server_url}/v1/audio/translations", data={"model": "whisper-1"},
        files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")}, headers=AUTH, timeout=60,
    )
    assert response.status_code == 400
    assert "English-only" in response.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}], ids=["no-key", "wrong-key"])
def test_requests_without_the_configured_api_key_get_401(server_url, headers):
    response = httpx.post(
        f"{server_url}/v1/audio/transcriptions", data={"model": "whisper-1"}, headers=headers,
        files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")}, timeout=60,
    )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
