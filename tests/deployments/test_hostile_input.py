"""Input made to hurt the server, against the default app with API keys on (one start-up): files of
many channels, a decoding process that faults, slow uploads, small files of an hour of audio each,
routes asked without a key, bad fields whose answers and logs must stay the client's (a 400, a short
message, no traceback in any log), and the same server idle (little CPU, no line per internal call)."""

from __future__ import annotations

import contextlib
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from deployments.http.errors import MAX_MESSAGE_CHARS
from engine.errors import QUOTED_CHARS
from engine.model.audio import SAMPLE_RATE, load_audio_file
from tests.support import ray_logs
from tests.support.app_metrics import metric_sum
from tests.support.encoding import MANY_CHANNEL_UPLOADS, UploadFormat, encode, in_every_channel
from tests.support.serving import (
    HOSTILE_API_KEY,
    KEYED_DECODE_PROCESSES,
    KEYED_MAX_AUDIO_S,
    KEYED_MAX_DECODED_AUDIO_S,
    keyed_app_args,
    running_app,
)
from tests.support.speech import SPEECH_DIR

pytestmark = pytest.mark.ray

API_KEY = HOSTILE_API_KEY
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JFK = (SPEECH_DIR / "jfk.flac").read_bytes()
JFK_WORDS = "ask not what your country can do for you"


# The app's bounds (tests/support/serving.py's keyed_app_args).
MAX_AUDIO_S = KEYED_MAX_AUDIO_S
MAX_DECODED_AUDIO_S = KEYED_MAX_DECODED_AUDIO_S
DECODE_PROCESSES = KEYED_DECODE_PROCESSES


@pytest.fixture(scope="module")
def server_url():
    # Shared with tests/deployments/test_realtime.py, which runs next.
    with running_app(keyed_app_args(), shared=True) as url:
        yield url


@pytest.fixture(scope="module")
def session_logs(server_url) -> Path:
    return ray_logs.session_logs()


def _transcribe(server_url: str, name: str, data: bytes, **fields) -> httpx.Response:
    return httpx.post(
        f"{server_url}/v1/audio/transcriptions",
        files={"file": (name, data, "application/octet-stream")},
        data={"model": "whisper-1", **fields},
        headers=AUTH,
        timeout=300,
    )


def _ingress() -> psutil.Process:
    """The ingress replica's process (the app has one), found by the title Ray gives it."""
    replicas = [
        process
        for process in psutil.process_iter(["cmdline"])
        if "ServeReplica:whisper:WhisperIngress" in " ".join(process.info["cmdline"] or [])
    ]
    assert len(replicas) == 1, replicas
    return replicas[0]


def _decoding_processes(ingress: psutil.Process) -> list[psutil.Process]:
    return [child for child in ingress.children() if "engine.model.decode_processes" in child.cmdline()]


# ---- files that crashed the server ------------------------------------------------------------------


def test_files_of_many_channels_are_transcribed_and_the_same_ingress_replica_serves_on(server_url):
    ingress = _ingress()
    jfk = load_audio_file(SPEECH_DIR / "jfk.flac")
    for case in MANY_CHANNEL_UPLOADS:
        response = _transcribe(server_url, f"speech.{case.upload.extension}", in_every_channel(jfk, case))
        assert response.status_code == 200, (case.name, response.text)
        assert JFK_WORDS in response.json()["text"].lower().replace(",", ""), case.name
    assert _ingress().pid == ingress.pid and ingress.is_running()
    assert JFK_WORDS in _transcribe(server_url, "jfk.flac", JFK).json()["text"].lower().replace(",", "")


def test_a_decoding_process_that_faults_fails_its_request_with_a_400_and_the_replica_serves_on(server_url):
    ingress = _ingress()
    workers = _decoding_processes(ingress)
    assert workers, "the ingress decodes uploads in processes of its own"
    # Stopped, a worker takes the upload but cannot answer; the fault lands while it holds it.
    for worker in workers:
        worker.send_signal(signal.SIGSTOP)
    outcome: dict[str, httpx.Response] = {}
    request = threading.Thread(
        target=lambda: outcome.update(response=_transcribe(server_url, "jfk.flac", JFK))
    )
    request.start()
    time.sleep(3)  # the upload reaches a worker well within it
    for worker in workers:
        worker.send_signal(signal.SIGSEGV)
        worker.send_signal(signal.SIGCONT)
    request.join(timeout=120)
    response = outcome["response"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_audio" and "crashed the decoder (signal SIGSEGV)" in error["message"]
    assert _ingress().pid == ingress.pid and ingress.is_running()
    assert JFK_WORDS in _transcribe(server_url, "jfk.flac", JFK).json()["text"].lower().replace(",", "")
    replaced = _decoding_processes(ingress)
    assert len(replaced) == len(workers) and not {w.pid for w in workers} & {w.pid for w in replaced}


# ---- slow uploads ---------------------------------------------------------------------------------

SLOW_UPLOADS = 300


def _slow_upload(url: httpx.URL) -> socket.socket:
    """An upload that sends its headers and 200 bytes of a 100 KB body, then waits."""
    connection = socket.create_connection((url.host, url.port), timeout=30)
    head = (
        f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: multipart/form-data; boundary=XYZ\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()
    field = b'--XYZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
    connection.sendall(head + field + b"x" * (200 - len(field)))
    return connection


def test_normal_requests_are_answered_while_hundreds_of_slow_uploads_are_held_open(server_url):
    """More slow uploads than the ingress has in-flight slots (256) and room for pending uploads
    from one address (64): the slow ones hold no slot, and the furthest behind the minimum rate
    give their places to uploads that arrive."""
    url = httpx.URL(f"{server_url}/v1/audio/transcriptions")
    with ThreadPoolExecutor(32) as pool:
        slow = list(pool.map(lambda _: _slow_upload(url), range(SLOW_UPLOADS)))
    try:
        time.sleep(2)  # every slow upload falls behind the minimum rate
        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(lambda _: _transcribe(server_url, "jfk.flac", JFK), range(20)))
        assert [response.status_code for response in responses] == [200] * 20, [
            response.text for response in responses if response.status_code != 200
        ][:3]
        assert all(JFK_WORDS in r.json()["text"].lower().replace(",", "") for r in responses)
    finally:
        for connection in slow:
            connection.close()


# ---- decompression bombs ------------------------------------------------------------------------------

BOMBS = 16
BOMB_S = MAX_AUDIO_S - 10
SAMPLE_BYTES = 4  # float32
# What the docs (docs/operations.md, "The memory bound") promise over the replica's idle memory:
# the decoded-audio bound in the replica, one file in each decoding process. The slack is for what
# the requests' own work takes beside their samples (uploads, speech detection, Python's heap).
MEMORY_BOUND_BYTES = (MAX_DECODED_AUDIO_S + DECODE_PROCESSES * MAX_AUDIO_S) * SAMPLE_RATE * SAMPLE_BYTES
SLACK_BYTES = 150 * 2**20


def _wav_claiming_one_hertz(duration_s: int) -> bytes:
    """A WAV of silence whose header says 1 sample a second: a few KB, an hour of samples decoded."""
    data = np.zeros(duration_s, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16)
    chunks = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def _flac_of_silence(duration_s: int) -> bytes:
    rate = 1000  # FLAC takes any rate; a low one keeps the test's encoding quick
    return encode(
        np.zeros(duration_s * rate, np.float32),
        UploadFormat("flac", "flac", "flac", "flac", "s16", rate),
        rate,
    )


def _memory_bytes(ingress: psutil.Process) -> int:
    """The resident memory of the ingress replica and its decoding processes together."""
    total = 0
    for process in [ingress, *_decoding_processes(ingress)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # a decoding process replaced meanwhile
            total += process.memory_info().rss
    return total


def test_sixteen_hour_long_bombs_at_once_keep_the_ingress_within_its_memory_bound_and_all_get_answers(
    server_url,
):
    """Sixteen files of an hour of silence each, a few KB to a few hundred KB on the wire, sent
    together: the replica holds two files' samples at most (its decoded-audio bound), the rest
    wait for room or for a decoding process and get a 503 after the wait; every one is answered
    (silence: an empty transcript), the replica's memory stays within the stated bound, and
    nothing is held after."""
    bombs = [("silence.wav", _wav_claiming_one_hertz(BOMB_S)), ("silence.flac", _flac_of_silence(BOMB_S))]
    assert all(len(data) < 2**19 for _, data in bombs)
    ingress = _ingress()
    idle_bytes = _memory_bytes(ingress)
    held_s: list[float] = []
    memory_bytes: list[int] = []
    finished = threading.Event()

    def watch_held() -> None:
        while not finished.is_set():
            held_s.append(metric_sum(server_url, "whisper_ingress_decoded_audio_seconds", AUTH))
            time.sleep(0.1)

    def watch_memory() -> None:  # apart from the scrapes, which may take a while under this load
        while not finished.is_set():
            memory_bytes.append(_memory_bytes(ingress))
            time.sleep(0.1)

    watchers = [threading.Thread(target=watch_held), threading.Thread(target=watch_memory)]
    for watcher in watchers:
        watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(BOMBS) as pool:
            responses = list(pool.map(lambda i: _transcribe(server_url, *bombs[i % 2]), range(BOMBS)))
    finally:
        finished.set()
        for watcher in watchers:
            watcher.join()
    answered_s = time.monotonic() - started
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, [r.text for r in responses if r.status_code not in (200, 503)]
    assert statuses.count(200) >= 2, statuses
    assert all(r.json()["text"] == "" for r in responses if r.status_code == 200)
    assert all(
        r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]
        for r in responses
        if r.status_code == 503
    )
    peak_bytes = max(memory_bytes)
    print(
        f"\n{BOMBS} bombs answered in {answered_s:.1f} s ({statuses.count(200)} x 200): memory "
        f"{idle_bytes / 2**20:.0f} MB idle, peak {peak_bytes / 2**20:.0f} MB, bound "
        f"{(idle_bytes + MEMORY_BOUND_BYTES) / 2**20:.0f} MB (+{SLACK_BYTES / 2**20:.0f} slack)"
    )
    assert peak_bytes - idle_bytes <= MEMORY_BOUND_BYTES + SLACK_BYTES
    assert BOMB_S <= max(held_s) <= MAX_DECODED_AUDIO_S
    deadline = time.monotonic() + 10
    while metric_sum(server_url, "whisper_ingress_decoded_audio_seconds", AUTH) > 0:
        assert time.monotonic() < deadline, "decoded samples still held after every answer"
        time.sleep(0.2)
    # The memory comes back too, the decoding processes' included.
    assert _memory_bytes(ingress) - idle_bytes < SLACK_BYTES


# ---- access -----------------------------------------------------------------------------------------

KEYED_ROUTES = [
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/whisper-1"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/redoc"),
]


@pytest.mark.parametrize("method, path", KEYED_ROUTES, ids=[path for _, path in KEYED_ROUTES])
def test_with_keys_set_a_route_answers_401_without_a_key_and_serves_with_one(server_url, method, path):
    files = {"file": ("jfk.flac", JFK, "audio/flac")} if method == "POST" else None
    data = {"model": "whisper-1"} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        refused = httpx.request(
            method, f"{server_url}{path}", headers=headers, files=files, data=data, timeout=60
        )
        assert refused.status_code == 401, (path, refused.text)
        assert refused.json()["error"]["code"] == "invalid_api_key"
    served = httpx.request(method, f"{server_url}{path}", headers=AUTH, files=files, data=data, timeout=300)
    # The default model is English-only: with the key, a translation is refused for that reason.
    assert served.status_code == (400 if path.endswith("translations") else 200), (path, served.text)
    if path == "/openapi.json":
        assert "/v1/audio/transcriptions" in served.json()["paths"]


def test_with_keys_set_health_and_ready_answer_without_a_key(server_url):
    # (A WebSocket without a key is refused at the upgrade: tests/deployments/test_realtime.py.)
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server_url}/ready", timeout=30).status_code in (200, 503)


# ---- the client's errors are the client's -------------------------------------------------------------


def _wav_of_channels(channels: int) -> bytes:
    """A 16-bit PCM WAV of ``channels`` channels written by hand: PyAV's encoders stop at 64."""
    data = np.zeros((1600, channels), "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, SAMPLE_RATE, SAMPLE_RATE * 2 * channels, 2 * channels, 16)
    chunks = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def _absurdly_loud_wav() -> bytes:
    samples = load_audio_file(SPEECH_DIR / "jfk.flac")[: 2 * SAMPLE_RATE].copy()
    samples[100] = 1e30  # finite, far past full scale
    return encode(samples, UploadFormat("wav", "wav", "wav", "pcm_f32le", "flt", SAMPLE_RATE))


HUGE = "q" * 10_000
BAD_FIELDS = [
    # id, file name and bytes, fields, the error's param, words its message holds
    ("huge-language", ("jfk.flac", JFK), {"language": HUGE}, "language", "is not available"),
    ("huge-temperature", ("jfk.flac", JFK), {"temperature": HUGE}, "temperature", "Invalid temperature"),
    ("huge-model", ("jfk.flac", JFK), {"model": HUGE}, "model", "does not exist"),
    (
        "benchmark-field",
        ("jfk.flac", JFK),
        {"fixed_output_tokens": "1000000000"},
        "fixed_output_tokens",
        "benchmarks",
    ),
    ("65-channels", ("many.wav", _wav_of_channels(65)), {}, "file", "has 65 channels"),
    ("samples-of-1e30", ("loud.wav", _absurdly_loud_wav()), {}, "file", "far outside full scale"),
]


def test_bad_fields_get_a_400_with_a_short_message_and_write_no_traceback_to_any_replica_log(
    server_url, session_logs
):
    assert any(session_logs.glob("serve/replica_*WhisperDecoder*.log")), sorted(session_logs.iterdir())
    sizes = ray_logs.log_sizes(session_logs)
    request_ids = {}
    for case_id, (name, data), fields, param, words in BAD_FIELDS:
        response = _transcribe(server_url, name, data, **fields)
        status = 404 if param == "model" else 400
        assert response.status_code == status, (case_id, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (case_id, error)
        assert len(error["message"]) <= MAX_MESSAGE_CHARS, case_id
        assert "q" * (QUOTED_CHARS + 1) not in error["message"], case_id
        request_ids[case_id] = response.headers["x-request-id"]
    time.sleep(2)  # Serve's log handlers write as they go; give the last lines time to land
    written = ray_logs.written_since(sizes, session_logs)
    tracebacks = {name: text for name, text in written.items() if "Traceback" in text}
    assert not tracebacks, {name: text[-3000:] for name, text in tracebacks.items()}
    # The decoder's rejection of a language is one INFO line that carries the request's id.
    decoder_lines = [
        line
        for text in written.values()
        for line in text.splitlines()
        if "WhisperDecoder" in line and "options were rejected" in line
    ]
    assert len(decoder_lines) == 1 and decoder_lines[0].startswith("INFO"), decoder_lines
    assert request_ids["huge-language"] in decoder_lines[0]
    assert len(decoder_lines[0]) < 1000


# ---- quiet when idle ----------------------------------------------------------------------------------


IDLE_S = 60  # what docs/operations.md states the figure over
# CPU time of every replica process together (their engine and decoding processes included) over
# IDLE_S with no traffic, as a share of one core. Loose: most of it is Ray's own upkeep of each
# actor (metrics reports, health checks), the machine is shared, and its clock ticks count in
# hundredths of a second, which IDLE_S must hold enough of.
IDLE_CPU_SHARE = 0.15


def _replica_processes() -> list[psutil.Process]:
    replicas = [
        process
        for process in psutil.process_iter(["cmdline"])
        if "ServeReplica:whisper:" in " ".join(process.info["cmdline"] or [])
    ]
    return replicas + [child for replica in replicas for child in replica.children(recursive=True)]


def _cpu_s(processes: list[psutil.Process]) -> dict[int, float]:
    spent = {}
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            spent[process.pid] = times.user + times.system
    return spent


def test_an_idle_server_spends_little_cpu_and_writes_no_line_per_internal_call(server_url, session_logs):
    """After a request, nothing: the encoders read the decoders' load only while they have windows
    (and a few polls past), Serve's access line per call stays on for the ingress's client
    requests only, and the replicas together spend a small share of one core."""
    before_request = ray_logs.log_sizes(session_logs)
    jfk = _transcribe(server_url, "jfk.flac", JFK)
    time.sleep(1)
    processes = _replica_processes()
    idle_from = ray_logs.log_sizes(session_logs)
    cpu_from = _cpu_s(processes)
    time.sleep(IDLE_S)
    cpu_to = _cpu_s(processes)
    idle_cpu_s = sum(cpu_to[pid] - cpu_from[pid] for pid in cpu_to.keys() & cpu_from.keys())
    idle_lines = "\n".join(ray_logs.written_since(idle_from, session_logs).values()).splitlines()
    print(f"\nidle {IDLE_S} s: {len(processes)} replica processes spent {idle_cpu_s:.2f} s of CPU")
    assert not [line for line in idle_lines if " CALL " in line], idle_lines[:5]
    assert len(idle_lines) < IDLE_S, idle_lines[:20]  # nothing per poll, many a second
    by_process = {pid: round(cpu_to[pid] - cpu_from[pid], 2) for pid in cpu_to.keys() & cpu_from.keys()}
    assert idle_cpu_s <= IDLE_CPU_SHARE * IDLE_S, by_process
    written = "\n".join(ray_logs.written_since(before_request, session_logs).values())
    assert f"{jfk.headers['x-request-id']} -- POST /v1/audio/transcriptions 200" in written
