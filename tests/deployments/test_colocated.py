"""`placement: colocated`: each decoder replica encodes its own windows (one process, the encoder on
a stream of its own on a GPU) and no encoder deployment or K/V transfer exists. The same API, the
same text as the offline engine, and the same guarantees: nothing lost under load, a client that
goes away frees what it held, a killed replica's requests are answered."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.model.loading import load_model
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions, FallbackOptions
from tests.support.app_metrics import metric_sum, scrape
from tests.support.load import run_load
from tests.support.serving import (
    default_app_args,
    engine_process,
    hang_up_once_decoding,
    running_app,
    statuses_with_a_replica_killed,
)
from tests.support.speech import SPEECH_DIR, english_clips

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def server_url():
    args = default_app_args()
    # No diarizer replica: no test here asks for speakers, and one process fewer starts and idles
    # beside the app's tests.
    args.pop("diarizer", None)
    with running_app(
        {
            **args,
            "placement": "colocated",
            # vad_by_default off: the requests are compared with the offline engine's text, which
            # cuts every window at quiet points without speech detection.
            "http": {**args["http"], "max_windows_in_flight": 1, "vad_by_default": False},
            # The engine in a process of its own here (deployments/engine_process.py); the other
            # serving tests run it in the replica's process, the default.
            "decoder": {**args.get("decoder", {}), "engine_process": True},
        }
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_benchmark_only_field_gets_a_400_naming_it_where_the_config_does_not_accept_them(client):
    """``http.benchmark_fields`` is off by default; tests/deployments/test_serving.py's app turns it
    on and decodes with ``fixed_output_tokens``."""
    with pytest.raises(openai.BadRequestError) as refused:
        with open(SPEECH_DIR / "jfk.flac", "rb") as audio:
            client.audio.transcriptions.create(
                model="whisper-1", file=audio, extra_body={"fixed_output_tokens": 37}
            )
    error = refused.value.response.json()["error"]
    assert error["param"] == "fixed_output_tokens" and error["type"] == "invalid_request_error"
    assert "'fixed_output_tokens' is for benchmarks only" in error["message"]


def test_concurrent_requests_get_the_offline_engines_text_and_the_encoder_reports_from_the_decoder(
    client, server_url
):
    clips = [c for c in english_clips() if c.duration_s <= 30][:7] + [
        c
        for c in english_clips()
        if c.duration_s > 30  # two windows, one after the other
    ]
    served = load_model(EngineConfig.model_validate(default_app_args()["engine"]))
    offline = Transcriber(loaded=served).transcribe(
        [clip.path for clip in clips], DecodeOptions(fallback=FallbackOptions())
    )
    before = scrape(server_url)

    def transcribe(clip) -> str:
        with open(clip.path, "rb") as audio:
            return client.audio.transcriptions.create(model="whisper-1", file=audio).text

    with ThreadPoolExecutor(len(clips)) as pool:
        texts = list(pool.map(transcribe, clips))
    assert texts == [result.text for result in offline]
    after = scrape(server_url)
    windows = after["whisper_decoder_windows_timed"] - before.get("whisper_decoder_windows_timed", 0)
    encoded = after["whisper_encoder_windows_encoded"] - before.get("whisper_encoder_windows_encoded", 0)
    assert windows >= len(clips) + 1 and encoded >= windows, "every window was encoded in the decoder replica"
    assert after["whisper_encoder_batches"] > before.get("whisper_encoder_batches", 0)
    # A colocated replica's forwards: on the worker thread within their time, and of that, waiting
    # for the kernels (none on a CPU, which computes as it launches).
    forwards_s = after["whisper_encoder_busy_seconds"] - before.get("whisper_encoder_busy_seconds", 0)
    worker_s = after["whisper_encoder_forward_seconds[worker]"] - before.get(
        "whisper_encoder_forward_seconds[worker]", 0
    )
    assert 0 < worker_s <= forwards_s
    assert after["whisper_encoder_forward_seconds[gpu_wait]"] == 0
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    assert (
        'whisper_transfer_info{connector="none",model="tiny.en",payload="encoder_states",replica="0"} 1.0'
        in metrics
    )
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used") == 0


def test_a_short_load_loses_nothing_and_frees_every_block(server_url):
    report = run_load(server_url, clients=8, duration_s=15, warmup_s=3)
    assert report.sent >= 8 and report.lost == [] and report.answered == report.sent
    assert report.statuses[200] >= 8 and report.unexpected_5xx == 0, report.statuses
    assert report.kv_blocks_used_at_end == 0


def test_a_client_that_disconnects_mid_decode_frees_its_windows(server_url):
    aborted_before = metric_sum(server_url, "whisper_decoder_windows_aborted")
    hang_up_once_decoding(server_url, {}, SPEECH_DIR / "multilingual.flac")
    deadline = time.monotonic() + 30
    while metric_sum(server_url, "whisper_decoder_windows_aborted") == aborted_before:
        assert time.monotonic() < deadline, "the decoder never aborted the window"
        time.sleep(0.2)
    while metric_sum(server_url, "whisper_decoder_kv_blocks_used") > 0:
        assert time.monotonic() < deadline, "blocks still held"
        time.sleep(0.2)


def test_killing_the_engine_process_mid_request_answers_every_request_and_the_replica_is_replaced(
    client, server_url
):
    """The engine's own process dies (an out-of-memory kill, a crash in a kernel): every call in
    flight fails at once rather than waiting for an answer, and the replica's health check fails,
    so Serve replaces it."""
    killed = engine_process()
    statuses = statuses_with_a_replica_killed(client, "WhisperDecoder", engine_process_only=True)
    assert not killed.is_running() or killed.status() == "zombie"
    assert set(statuses) <= {200, 503}, statuses
    deadline = time.monotonic() + 120
    while True:  # 503s until Serve has replaced the replica
        try:
            with open(SPEECH_DIR / "jfk.flac", "rb") as audio:
                text = client.audio.transcriptions.create(model="whisper-1", file=audio).text
            break
        except openai.APIStatusError as error:
            assert error.status_code == 503 and time.monotonic() < deadline, error
            time.sleep(1)
    assert "ask not what your country" in text
    assert engine_process().pid != killed.pid


def test_killing_the_replica_mid_request_answers_every_request(client, server_url):
    """Runs last: it kills the one replica (Serve replaces it)."""
    statuses = statuses_with_a_replica_killed(client, "WhisperDecoder")
    assert set(statuses) <= {200, 503}, statuses  # every request answered: a result or a clean 503
    with open(SPEECH_DIR / "jfk.flac", "rb") as audio:
        text = client.audio.transcriptions.create(model="whisper-1", file=audio).text
    assert "ask not what your country" in text
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used") == 0
