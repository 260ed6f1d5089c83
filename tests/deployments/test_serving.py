"""The default app (configs/default.yaml) on a real local Ray and Serve, spoken to over HTTP with
the official openai client: same text as the offline API, 32 concurrent requests, formats, errors."""

from __future__ import annotations

import hashlib
import io
import math
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
import srt
import webvtt

from engine.config import EngineConfig
from engine.model.audio import load_audio_file
from engine.model.loading import LoadedModel, load_model
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions, FallbackOptions
from tests.support.app_metrics import labelled_sum, metric_sum, scrape, server_timing_ms, steady_figures
from tests.support.load import run_load
from tests.support.serving import (
    default_app_args,
    hang_up_once_decoding,
    running_app,
    statuses_with_a_replica_killed,
)
from tests.support.speech import SPEECH_DIR, english_clips

pytestmark = pytest.mark.ray

API_KEY = "test-key-123"  # the default app, with API keys switched on to test them too
AUTH = {"Authorization": f"Bearer {API_KEY}"}
INLINE_WINDOW_KB = 512  # not the default (0, Ray's own limit): the test server sends short windows inline


@pytest.fixture(scope="module")
def server_url(offline_texts_underway):
    args = default_app_args()
    # No diarizer replica: no test here asks for speakers (tests/deployments/test_diarization.py
    # does), and one process fewer starts and idles beside the app's tests.
    args.pop("diarizer", None)
    # API keys on, a 60 s duration limit, 40 requests in flight and a 3 s upload timeout, to test them;
    # one window of a file in flight at a time, so the two-window files run the sliding window.
    http_limits = {
        **args.get("http", {}),
        "api_keys": [API_KEY],
        "max_audio_duration_s": 60,
        "max_in_flight_requests": 40,
        "upload_timeout_s": 3,
        "max_windows_in_flight": 1,
        "inline_window_kb": INLINE_WINDOW_KB,
        "benchmark_fields": True,  # fixed_output_tokens is tested here; refused by default (test_colocated)
        # No speech detection (the shipped default detects it): the tests compare with the offline
        # API's text and count windows, both of audio cut at quiet points. Speech detection over
        # HTTP is tests/deployments/test_ingest.py's.
        "vad_by_default": False,
    }
    # Unclaimed K/V staging expires after 10 s instead of 120 s, so the fault tests can watch it go.
    transfer = {**args["transfer"], "unclaimed_timeout_s": 10}
    with running_app({**args, "http": http_limits, "transfer": transfer}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served_model() -> LoadedModel:
    """The offline API with the engine settings the default app serves with (engine.cpu_dtype
    included): the text each served request must match."""
    return load_model(EngineConfig.model_validate(default_app_args()["engine"]))


SPEECH_SET_CLIP_IDS = ["jfk", "osr72_01", "tts_05", "tts_18", "osr_list72"]  # osr_list72: 35 s, two windows
THIRTY_TWO_CLIPS = [clip for clip in english_clips() if clip.duration_s <= 30][:32]
# The clips whose offline text this module compares with, and no more: each costs the offline API
# a transcription on the test's worker, beside the app.
OFFLINE_CLIP_IDS = {*SPEECH_SET_CLIP_IDS, *(clip.id for clip in THIRTY_TWO_CLIPS)}


def _offline_texts(served_model: LoadedModel) -> dict[str, str]:
    clips = [clip for clip in english_clips() if clip.id in OFFLINE_CLIP_IDS]
    # The API's defaults: temperature 0 with openai-whisper's fallback.
    transcriptions = Transcriber(loaded=served_model).transcribe(
        [clip.path for clip in clips], DecodeOptions(fallback=FallbackOptions())
    )
    return {clip.id: result.text for clip, result in zip(clips, transcriptions)}


@pytest.fixture(scope="module")
def offline_texts_underway(served_model) -> Iterator[Future[dict[str, str]]]:
    """offline_texts, computed on a thread of this process from before the app starts (server_url
    asks for this first): while serve.run waits for the replicas' processes to start, the offline
    API takes the CPU they leave."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_offline_texts, served_model)


@pytest.fixture(scope="module")
def offline_texts(offline_texts_underway) -> dict[str, str]:
    return offline_texts_underway.result()


def _transcribe(client: openai.OpenAI, path: Path, **kwargs):
    with open(path, "rb") as audio:
        return client.audio.transcriptions.create(model="whisper-1", file=audio, **kwargs)


def test_the_openai_client_gets_the_offline_apis_text_for_speech_set_clips(client, offline_texts):
    for clip_id in SPEECH_SET_CLIP_IDS:
        clip = next(c for c in english_clips() if c.id == clip_id)
        assert _transcribe(client, clip.path).text == offline_texts[clip_id], clip_id


def test_beam_size_gives_the_offline_apis_beam_search_text_over_http(client, served_model):
    clips = [clip for clip in english_clips() if clip.id in ("jfk", "tts_05", "osr_list72")]
    options = DecodeOptions(fallback=FallbackOptions(), beam_size=5, patience=1.5)
    expected = Transcriber(loaded=served_model).transcribe([clip.path for clip in clips], options)
    for clip, offline in zip(clips, expected):
        served = _transcribe(client, clip.path, extra_body={"beam_size": 5, "patience": 1.5})
        assert served.text == offline.text, clip.id


def test_thirty_two_concurrent_requests_each_match_their_single_request_text_and_free_all_blocks(
    client, server_url, offline_texts
):
    clips = THIRTY_TWO_CLIPS
    assert len(clips) == 32
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(lambda clip: _transcribe(client, clip.path).text, clips))
    assert texts == [offline_texts[clip.id] for clip in clips]
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH) == 0
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_free", AUTH) > 0, "the decoder reported its pool"


def _seconds(clock: str) -> float:
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def test_text_srt_vtt_and_verbose_json_formats(client, served_model, offline_texts):
    path = SPEECH_DIR / "osr_list72.flac"  # 35.5 s: two windows, cut in a pause near 25 s
    assert _transcribe(client, path, response_format="text").strip() == offline_texts["osr_list72"]
    # Formats with times decode with Whisper's timestamp tokens, as the offline API does when asked.
    offline = Transcriber(loaded=served_model).transcribe(
        [path], DecodeOptions(timestamps=True, fallback=FallbackOptions())
    )[0]
    verbose = _transcribe(client, path, response_format="verbose_json")
    assert verbose.text == offline.text and verbose.language == "en" and abs(verbose.duration - 35.55) < 0.01
    times = [(s.start, s.end) for s in verbose.segments]
    assert len(times) >= 4, "one segment per sentence or so, not one per window"
    assert all(0 <= start <= end <= verbose.duration for start, end in times)
    assert all(a[1] <= b[0] for a, b in zip(times, times[1:])), "segments are in order and do not overlap"
    assert times[-1][1] > 34, "the last window's segments sit on the file's timeline, to its end"
    srt_body = _transcribe(client, path, response_format="srt")
    blocks = [block.splitlines() for block in srt_body.strip().split("\n\n")]
    assert [int(block[0]) for block in blocks] == list(range(1, len(times) + 1))
    assert blocks[0][1] == f"00:00:00,000 --> 00:00:{times[0][1]:06.3f}".replace(".", ",")
    vtt = _transcribe(client, path, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.count(" --> ") == len(times)
    # Standard parsers read both, with the segments' times and text.
    subtitles = list(srt.parse(srt_body))
    parsed_times = [t for s in subtitles for t in (s.start.total_seconds(), s.end.total_seconds())]
    assert parsed_times == pytest.approx([t for pair in times for t in pair], abs=1e-3)
    assert " ".join(s.content for s in subtitles).split() == verbose.text.split()
    captions = webvtt.from_string(vtt).captions
    assert [_seconds(c.start) for c in captions] == pytest.approx([t[0] for t in times], abs=1e-3)
    assert " ".join(c.text for c in captions).split() == verbose.text.split()


def test_a_streamed_long_file_gets_a_delta_per_window_that_join_to_the_final_text(client, offline_texts):
    path = SPEECH_DIR / "osr_list72.flac"  # 35.5 s: two windows
    with open(path, "rb") as audio:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True))
    deltas = [event.delta for event in events if event.type == "transcript.text.delta"]
    assert [event.type for event in events[len(deltas) :]] == ["transcript.text.done"], (
        "deltas, then one done"
    )
    assert len(deltas) >= 2
    assert "".join(deltas) == events[-1].text == offline_texts["osr_list72"]


def test_word_timestamps_come_in_verbose_json_inside_their_segments(client):
    verbose = _transcribe(
        client,
        SPEECH_DIR / "osr_list72.flac",
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    words = verbose.words
    assert len(words) == len(verbose.text.split())
    assert [w.word for w in words] == verbose.text.split()
    assert all(a.start <= b.start for a, b in zip(words, words[1:])) and all(w.start <= w.end for w in words)
    assert all(any(s.start <= w.start <= w.end <= s.end for s in verbose.segments) for w in words)


def test_sequential_long_form_over_http_matches_the_offline_sequential_transcript(client, served_model):
    path = SPEECH_DIR / "osr_list72.flac"
    offline = Transcriber(loaded=served_model).transcribe(
        [path], DecodeOptions(fallback=FallbackOptions()), long_form="sequential"
    )[0]
    verbose = _transcribe(
        client, path, response_format="verbose_json", extra_body={"long_form": "sequential"}
    )
    assert verbose.text == offline.text
    assert all(a.end <= b.start for a, b in zip(verbose.segments, verbose.segments[1:]))


def test_the_default_app_moves_cross_attention_kv_over_nixl(client, server_url):
    _transcribe(client, SPEECH_DIR / "osr72_02.flac")
    metrics = httpx.get(f"{server_url}/metrics", headers=AUTH, timeout=30).text
    assert (
        'whisper_transfer_info{connector="nixl",model="tiny.en",payload="cross_kv",replica="0"} 1.0'
        in metrics
    )
    precision = EngineConfig.model_validate(default_app_args()["engine"]).encoder_precision
    assert (
        f'whisper_encoder_precision_info{{model="tiny.en",precision="{precision}",replica="0"}} 1.0'
        in metrics
    )
    staged = [line for line in metrics.splitlines() if line.startswith("whisper_encoder_staged{")]
    assert staged and float(staged[0].split()[-1]) == 0, "every staged window was pulled and released"
    assert metric_sum(server_url, "whisper_decoder_kv_loads", AUTH) > 0, "pulled beside the decode loop"


def test_the_ingress_replicas_processes_carry_the_inline_window_limit_ray_reads(server_url):
    """http.inline_window_kb reaches the ingress replicas' processes, where Ray's workers read the
    largest argument they send inside a call; short windows then skip Ray's object store."""
    expected = str(INLINE_WINDOW_KB * 1024).encode()
    ingresses = [
        proc
        for proc in Path("/proc").iterdir()
        if proc.name.isdigit() and b"ServeReplica:whisper:WhisperIngress" in _read_or_empty(proc / "cmdline")
    ]
    assert ingresses, "no ingress replica process found"
    for proc in ingresses:
        environment = _read_or_empty(proc / "environ").split(b"\0")
        assert b"RAY_max_direct_call_object_size=" + expected in environment, proc.name


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile, or one of another user's
        return b""


def test_metrics_and_server_timing_account_for_a_windows_time(server_url):
    before = scrape(server_url, AUTH)
    started = time.monotonic()
    response = httpx.post(
        f"{server_url}/v1/audio/transcriptions",
        headers=AUTH,
        data={"model": "whisper-1"},
        files={"file": ("osr72_02.flac", (SPEECH_DIR / "osr72_02.flac").read_bytes())},  # one 30 s window
        timeout=120,
    )
    latency_s = time.monotonic() - started
    after = scrape(server_url, AUTH)
    figures = steady_figures(before, after, latency_s)
    assert response.status_code == 200
    # The ingress's own phases come back as a Server-Timing header, within what the client saw.
    phases = server_timing_ms(response.headers)
    assert list(phases) == ["upload", "options", "audio", "windows", "format"]
    assert all(ms >= 0 for ms in phases.values()) and sum(phases.values()) <= 1000 * latency_s

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("whisper_decoder_windows_timed") == 1 and delta("whisper_encoder_windows_encoded") == 1
    assert delta("whisper_encoder_batches") == 1
    # Each sampled token took a row of a step; one window alone runs one row a step.
    assert delta("whisper_decoder_steps") >= delta("whisper_decoder_tokens_generated") > 0
    assert figures["decode_batch"] == 1 and figures["step_ms"] > 0
    stages = [figures[key] for key in ("encoder_queued_s", "encoder_forward_s", "decoder_queued_s")]
    stages += [figures["kv_loading_s"], figures["decoding_s"]]
    assert (
        all(stage >= 0 for stage in stages) and figures["encoder_forward_s"] > 0 and figures["decoding_s"] > 0
    )
    assert sum(stages) <= latency_s, "the stages are parts of the request's own time"
    # The window's K/V travelled: its load, in parts that add up to it, spent time pulling.
    load_parts = [figures[key] for key in ("kv_worker_queue_s", "kv_pull_s", "kv_pickup_s")]
    assert all(part >= 0 for part in load_parts) and figures["kv_pull_s"] > 0
    assert sum(load_parts) == pytest.approx(figures["kv_loading_s"])
    # The forward's own time: on its worker thread within it; the disaggregated encoder does not
    # measure its wait for the GPU, which is then unknown rather than zero.
    assert 0 < figures["forward_worker_s"] <= figures["forward_s"]
    # One forward, one window: the window is handed on within its forward, once staged.
    assert 0 < figures["encoder_forward_s"] <= figures["forward_s"]
    assert math.isnan(figures["forward_gpu_wait_s"])


def test_the_audio_seconds_counter_labels_an_api_keys_usage_by_a_hash_never_by_the_key(server_url, client):
    label = hashlib.sha256(API_KEY.encode()).hexdigest()[:8]
    before = labelled_sum(server_url, "whisper_audio_seconds_total", AUTH, model="tiny.en", api_key=label)
    verbose = _transcribe(client, SPEECH_DIR / "jfk.flac", response_format="verbose_json")
    after = labelled_sum(server_url, "whisper_audio_seconds_total", AUTH, model="tiny.en", api_key=label)
    assert verbose.usage.seconds == pytest.approx(verbose.duration, abs=0.01)
    assert after - before == pytest.approx(verbose.usage.seconds, abs=0.01), "the response's usage, billed"
    assert API_KEY not in httpx.get(f"{server_url}/metrics", headers=AUTH, timeout=30).text


def test_ready_is_503_until_a_warm_up_window_has_gone_through_encoder_and_decoder_then_200(server_url):
    # The first probe starts the warm-up, so it answers before any window can have gone through.
    first = httpx.get(f"{server_url}/ready", timeout=30)
    assert first.status_code == 503 and first.headers["retry-after"] == "1"
    assert first.json()["error"]["code"] == "not_ready"
    deadline = time.monotonic() + 120
    while (probe := httpx.get(f"{server_url}/ready", timeout=30)).status_code == 503:
        assert time.monotonic() < deadline, probe.json()
        time.sleep(0.2)
    assert probe.status_code == 200 and probe.json()["status"] == "ready"
    assert probe.json()["warm_up_s"] > 0


def test_models_and_health_routes(server_url):
    models = httpx.get(f"{server_url}/v1/models", headers=AUTH, timeout=30).json()
    assert {m["id"] for m in models["data"]} >= {"whisper-1", "tiny.en"}
    assert httpx.get(f"{server_url}/health", timeout=30).json() == {"status": "ok"}


def test_fixed_output_tokens_makes_a_window_decode_exactly_that_many_tokens_for_benchmarks(
    client, server_url
):
    before = metric_sum(server_url, "whisper_decoder_tokens_generated", AUTH)
    with open(SPEECH_DIR / "jfk.flac", "rb") as audio:  # one window
        client.audio.transcriptions.create(
            model="whisper-1", file=audio, extra_body={"fixed_output_tokens": 37}
        )
    assert metric_sum(server_url, "whisper_decoder_tokens_generated", AUTH) - before == 37, (
        "past its end of text too"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        with open(SPEECH_DIR / "jfk.flac", "rb") as audio:
            client.audio.transcriptions.create(
                model="whisper-1", file=audio, extra_body={"fixed_output_tokens": 0}
            )
    assert refused.value.body["param"] == "fixed_output_tokens"


def _encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _jfk_at(rate: int, channels: int = 1, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    from engine.model.audio import resample

    samples = resample(load_audio_file(SPEECH_DIR / "jfk.flac"), 16000, rate)
    return _encoded(np.stack([samples] * channels, axis=1) if channels > 1 else samples, rate, fmt, subtype)


JFK = (SPEECH_DIR / "jfk.flac").read_bytes()
WAV_HEADER_ONLY = _encoded(np.zeros(16000, dtype=np.float32), 16000, "WAV", "PCM_16")[:40]
NAN_WAV = _encoded(np.full(1600, np.nan, dtype=np.float32), 16000, "WAV", "FLOAT")
LONG_WAV = _encoded(
    np.tile(load_audio_file(SPEECH_DIR / "osr_list72.flac"), 2), 16000, "WAV", "PCM_16"
)  # 71 s

BAD_REQUESTS = [
    # id, file (name, bytes) or None, extra fields, status, error param
    ("not-audio", ("notes.wav", b"meeting notes, not audio" * 10), {}, 400, "file"),
    ("empty-file", ("empty.wav", b""), {}, 400, "file"),
    ("text-named-wav", ("speech.wav", b"RIFF but really a text file\n" * 50), {}, 400, "file"),
    ("truncated-wav-header", ("cut.wav", WAV_HEADER_ONLY), {}, 400, "file"),
    ("corrupt-flac", ("bad.flac", JFK[:4] + bytes(200) + JFK[204:1000]), {}, 400, "file"),
    ("corrupt-mp3", ("bad.mp3", b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\xff" * 50), {}, 400, "file"),
    ("nan-samples", ("nan.wav", NAN_WAV), {}, 400, "file"),
    ("missing-file", None, {}, 400, "file"),
    ("unknown-model", ("jfk.flac", JFK), {"model": "/etc/passwd"}, 404, "model"),
    ("missing-model", ("jfk.flac", JFK), {"model": ""}, 400, "model"),
    ("bad-format", ("jfk.flac", JFK), {"response_format": "docx"}, 400, "response_format"),
    ("bad-temperature", ("jfk.flac", JFK), {"temperature": "7"}, 400, "temperature"),
    ("nan-temperature", ("jfk.flac", JFK), {"temperature": "warm"}, 400, "temperature"),
    (
        "bad-granularity",
        ("jfk.flac", JFK),
        {"timestamp_granularities[]": "sentence"},
        400,
        "timestamp_granularities[]",
    ),
    ("bad-language", ("jfk.flac", JFK), {"language": "klingon"}, 400, "language"),
    ("bad-long-form", ("jfk.flac", JFK), {"long_form": "sideways"}, 400, "long_form"),
    ("beam-size-zero", ("jfk.flac", JFK), {"beam_size": "0"}, 400, "beam_size"),
    ("beam-size-too-wide", ("jfk.flac", JFK), {"beam_size": "64"}, 400, "beam_size"),
    ("patience-without-beams", ("jfk.flac", JFK), {"patience": "2"}, 400, "patience"),
    ("best-of-zero", ("jfk.flac", JFK), {"best_of": "0"}, 400, "best_of"),
    (
        "bad-length-penalty",
        ("jfk.flac", JFK),
        {"beam_size": "5", "length_penalty": "3"},
        400,
        "length_penalty",
    ),
    ("streamed-srt", ("jfk.flac", JFK), {"stream": "true", "response_format": "srt"}, 400, "stream"),
    ("bad-threshold", ("jfk.flac", JFK), {"logprob_threshold": "low"}, 400, "logprob_threshold"),
    ("over-duration-limit", ("long.wav", LONG_WAV), {}, 413, "file"),
    ("over-size-limit", ("huge.wav", b"\x00" * (26 * 2**20)), {}, 413, "file"),
]


@pytest.mark.parametrize(
    "upload, fields, status, param", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_requests_get_openai_error_json_and_the_server_keeps_serving(
    client, server_url, upload, fields, status, param
):
    files = {"file": (upload[0], upload[1], "application/octet-stream")} if upload else {"other": ("x", b"x")}
    response = httpx.post(
        f"{server_url}/v1/audio/transcriptions",
        files=files,
        data={"model": "whisper-1", **fields},
        headers=AUTH,
        timeout=120,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert "ask not what your country" in _transcribe(client, SPEECH_DIR / "jfk.flac").text


@pytest.mark.parametrize(
    "name, data",
    [
        ("8k.wav", _jfk_at(8000)),
        ("44k1-stereo.wav", _jfk_at(44100, channels=2)),
        ("48k-24bit.wav", _jfk_at(48000, subtype="PCM_24")),
        ("jfk.mp3", _jfk_at(44100, fmt="MP3", subtype="MPEG_LAYER_III")),
    ],
    ids=["8kHz", "44.1kHz-stereo", "48kHz-24bit", "mp3"],
)
def test_other_rates_channels_depths_and_formats_are_converted_and_transcribed(client, name, data):
    text = client.audio.transcriptions.create(model="whisper-1", file=(name, data)).text
    assert "ask not what your country can do for you" in text.lower().replace(",", "")


@pytest.mark.parametrize(
    "name, samples", [("nothing.wav", np.zeros(0, np.float32)), ("silence.wav", np.zeros(32000, np.float32))]
)
def test_zero_length_and_silent_audio_get_a_valid_transcript_not_an_error(client, name, samples):
    verbose = client.audio.transcriptions.create(
        model="whisper-1",
        file=(name, _encoded(samples, 16000, "WAV", "PCM_16")),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert isinstance(verbose.text, str) and abs(verbose.duration - len(samples) / 16000) < 0.01
    assert isinstance(verbose.words, list)
    if len(samples) == 0:
        assert (
            verbose.text == "" and verbose.segments is None and verbose.words == []
        )  # word alone: no segments, as OpenAI


def test_translation_on_an_english_only_model_is_a_clear_400(server_url):
    response = httpx.post(
        f"{server_url}/v1/audio/translations",
        data={"model": "whisper-1"},
        files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")},
        headers=AUTH,
        timeout=60,
    )
    assert response.status_code == 400
    assert "English-only" in response.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}], ids=["no-key", "wrong-key"])
def test_requests_without_the_configured_api_key_get_401(server_url, headers):
    response = httpx.post(
        f"{server_url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        headers=headers,
        files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), "audio/flac")},
        timeout=60,
    )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_short_load_of_sixteen_looping_clients_loses_nothing_and_frees_everything(server_url):
    """The short version of benchmarks/bench_load.py (64 clients for 5 minutes), its clients in two
    processes of their own."""
    report = run_load(server_url, clients=16, duration_s=20, warmup_s=5, api_key=API_KEY, processes=2)
    assert report.sent >= 16 and report.lost == [] and report.answered == report.sent
    assert report.statuses[200] >= 16 and report.unexpected_5xx == 0, report.statuses
    assert report.kv_blocks_used_at_end == 0 and report.staged_at_end == 0
    # Where the CPU went while it ran: the clients' own process, every serving process, the machine.
    cores = report.cpu_cores
    for process in (
        "a load generator process",
        "ServeReplica:whisper:WhisperIngress",
        "ServeReplica:whisper:WhisperDecoder",
    ):
        assert any(name.startswith(process) and busy > 0 for name, busy in cores.items()), (process, cores)
    machine = next(busy for name, busy in cores.items() if name.startswith("the whole machine"))
    assert max(cores.values()) <= machine + 0.1  # no process busier than the machine it runs on


def test_a_client_that_disconnects_mid_decode_aborts_its_windows_and_frees_their_blocks(server_url):
    aborted_before = metric_sum(server_url, "whisper_decoder_windows_aborted", AUTH)
    hang_up_once_decoding(server_url, AUTH, SPEECH_DIR / "multilingual.flac")
    # The connection is closed: Serve cancels the request, the decoder aborts and frees its windows.
    deadline = time.monotonic() + 30
    while (
        metric_sum(server_url, "whisper_decoder_windows_aborted", AUTH) == aborted_before
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert metric_sum(server_url, "whisper_decoder_windows_aborted", AUTH) > aborted_before
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH) == 0


_MODEL_FIELD = b'--XYZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
_JFK_FILE_HEAD = (
    b'--XYZ\r\nContent-Disposition: form-data; name="file"; filename="jfk.flac"\r\n'
    b"Content-Type: audio/flac\r\n\r\n"
)


def _raw_upload_head(url: httpx.URL, content_length: int) -> bytes:
    """An upload's request line and headers, and the form's model field, as a raw socket sends them."""
    return (
        f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: multipart/form-data; boundary=XYZ\r\n"
        f"Content-Length: {content_length}\r\nConnection: close\r\n\r\n"
    ).encode() + _MODEL_FIELD


def test_a_body_that_never_finishes_gets_408_after_the_upload_timeout(server_url):
    url = httpx.URL(f"{server_url}/v1/audio/transcriptions")
    head = _raw_upload_head(url, 100_000)
    started = time.monotonic()
    with socket.create_connection((url.host, url.port), timeout=30) as connection:
        connection.sendall(head)  # ...and never the rest
        reply = b""
        while b"upload_timeout" not in reply and (chunk := connection.recv(65536)):
            reply += chunk  # the status line and the JSON body may arrive in separate packets
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert '"code":"upload_timeout"' in reply.replace(" ", "")
    assert 2.5 < time.monotonic() - started < 20


def test_a_body_that_keeps_arriving_is_transcribed_though_it_takes_longer_than_the_upload_timeout(
    server_url,
):
    """The upload timeout (3 s here) bounds the gaps in a body, not the whole: a slow link is served."""
    url = httpx.URL(f"{server_url}/v1/audio/transcriptions")
    file_part = _JFK_FILE_HEAD + (SPEECH_DIR / "jfk.flac").read_bytes() + b"\r\n--XYZ--\r\n"
    head = _raw_upload_head(url, len(_MODEL_FIELD) + len(file_part))
    pieces = [file_part[i * len(file_part) // 3 : (i + 1) * len(file_part) // 3] for i in range(3)]
    started = time.monotonic()
    with socket.create_connection((url.host, url.port), timeout=60) as connection:
        connection.sendall(head)
        for piece in pieces:
            time.sleep(2.0)  # each gap within the timeout, the three of them beyond it
            connection.sendall(piece)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    assert time.monotonic() - started > 6
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"ask not what your country" in reply


def test_a_body_that_trickles_in_gets_408_once_it_falls_behind_the_minimum_upload_rate(server_url):
    """Every gap well within the upload timeout (3 s here), but 20 bytes a second: under the default
    http.min_upload_bytes_per_s (500), so the body may take 3 s plus a second per 500 bytes."""
    url = httpx.URL(f"{server_url}/v1/audio/transcriptions")
    audio = (SPEECH_DIR / "jfk.flac").read_bytes()
    started = time.monotonic()
    reply = b""
    with socket.create_connection((url.host, url.port), timeout=0.5) as connection:
        head = _raw_upload_head(url, len(_MODEL_FIELD) + len(_JFK_FILE_HEAD) + len(audio))
        connection.sendall(head + _JFK_FILE_HEAD)
        for offset in range(0, len(audio), 10):
            if b"upload_too_slow" in reply or time.monotonic() - started > 30:
                break
            try:
                connection.sendall(audio[offset : offset + 10])
                reply += connection.recv(65536)  # waits up to 0.5 s: 20 bytes a second
            except TimeoutError:
                continue
            except OSError:
                break  # the server answered and closed the connection
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b'"code":"upload_too_slow"' in reply.replace(b" ", b"")
    assert 3 < time.monotonic() - started < 20


def test_a_burst_beyond_the_in_flight_limit_gets_503_with_retry_after_and_loses_nothing(server_url, client):
    clips = [c for c in english_clips() if c.duration_s <= 5][:10]
    payloads = [(c.path.name, c.path.read_bytes()) for c in clips]

    def send(index: int) -> httpx.Response:
        name, data = payloads[index % len(payloads)]
        return httpx.post(
            f"{server_url}/v1/audio/transcriptions",
            headers=AUTH,
            files={"file": (name, data)},
            data={"model": "whisper-1"},
            timeout=300,
        )

    with ThreadPoolExecutor(100) as pool:
        responses = list(pool.map(send, range(100)))  # 100 at once, the test server admits 40
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) == {200, 503} and statuses[200] >= 40, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "overloaded"
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH) == 0
    assert "ask not what your country" in _transcribe(client, SPEECH_DIR / "jfk.flac").text


@pytest.mark.parametrize("deployment", ["WhisperDecoder", "WhisperEncoder"])
def test_killing_a_replica_mid_request_answers_every_request_and_leaks_no_blocks(
    client, server_url, deployment
):
    """Runs last in this module: it kills a replica of the shared server (Serve replaces it)."""

    statuses = statuses_with_a_replica_killed(client, deployment)
    assert set(statuses) <= {200, 503}, statuses  # every request answered: a result or a clean 503
    # The replacement replica serves, and nothing is left holding KV blocks or staging.
    assert "ask not what your country" in _transcribe(client, SPEECH_DIR / "jfk.flac").text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (
            metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH) == 0
            and metric_sum(server_url, "whisper_encoder_staged", AUTH) == 0
        ):
            break
        time.sleep(0.5)
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH) == 0
    assert metric_sum(server_url, "whisper_encoder_staged", AUTH) == 0
