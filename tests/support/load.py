"""A load generator for the running app: many concurrent clients sending the speech set's clips for
a while, one request at a time each, with what the app's counters, its processes' memory and CPU
saw meanwhile. tests/deployments/test_serving.py runs a short version; benchmarks/bench_load.py the
long one with its tables."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import httpx
import psutil

from engine.transcribe.evaluation import load_manifest
from tests.support.app_metrics import metric_sum, scrape, server_timing_ms, steady_figures
from tests.support.paths import SPEECH_DIR  # not speech.py's, which imports torch: clients start without

# Which answered requests a latency figure covers: all, clips over one 30 s window, or the others.
Clips = Literal["all", "long", "short"]


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    wall_s: float = 0.0  # until the last request answered: longer than duration_s by the tail
    sent: int = 0
    answered: int = 0
    statuses: Counter = field(default_factory=Counter)
    # (seconds of audio, seconds from sending to the answer) of each request answered 200
    transcribed: list[tuple[float, float]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # requests with no HTTP answer (timeouts, resets)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # process -> samples after warm-up
    kv_blocks_used_at_end: float = float("nan")
    staged_at_end: float = float("nan")
    tokens_decoded: float = float("nan")  # by the decoders while the load ran (their counters)
    # The app's own counters over the steady part of the run, from the end of the warm-up to the
    # moment clients stop sending (no ramp-up, no drain): see steady_figures().
    steady: dict[str, float] = field(default_factory=dict)
    # Sums of the ingress's phases (its Server-Timing header, ms) over the answered requests.
    server_phases_ms: Counter = field(default_factory=Counter)
    # Cores each process kept busy over the steady part (user + system CPU time / wall time): a
    # process near 1.0 is a single Python thread's limit, and its queue is part of the latency.
    cpu_cores: dict[str, float] = field(default_factory=dict)

    @property
    def audio_s(self) -> float:
        return sum(audio_s for audio_s, _ in self.transcribed)

    def latencies_s(self, clips: Clips = "all") -> list[float]:
        """``clips``: "all", "long" (over one 30 s window) or "short" (one window each)."""
        return [
            latency_s
            for audio_s, latency_s in self.transcribed
            if clips == "all" or (audio_s > 30) == (clips == "long")
        ]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_decoded / self.wall_s if self.wall_s else float("nan")

    @property
    def unexpected_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500 and status not in (503,))

    @property
    def max_rss_growth(self) -> float:
        """Largest relative growth of any process's RSS from its first to its last sample."""
        growth = [(s[-1] - s[0]) / s[0] for s in self.rss_mb.values() if len(s) >= 2 and s[0] > 0]
        return max(growth, default=0.0)

    def absorb(self, part: LoadReport) -> None:
        """Add the requests of one load-generating process's clients."""
        self.sent += part.sent
        self.answered += part.answered
        self.statuses.update(part.statuses)
        self.transcribed += part.transcribed
        self.lost += part.lost
        self.server_phases_ms.update(part.server_phases_ms)

    def percentile_s(self, q: float, clips: Clips = "all") -> float:
        values = sorted(self.latencies_s(clips))
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _serving_processes() -> dict[int, str]:
    """Ray's serving processes on this machine: the replicas, the proxy, the controller, and the
    processes a replica started (a decoder's engine process)."""
    found = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        for marker in ("ServeReplica:", "ProxyActor", "ServeController"):
            if marker in command:
                # Ray's process title, less the method it runs now ("ProxyActor.receive_asgi_messages").
                name = command.split("ray::", 1)[-1].split()[0].split(".")[0]
                found[process.info["pid"]] = name
                with contextlib.suppress(psutil.Error):
                    for child in process.children(recursive=True):
                        found[child.pid] = f"{name}, a process it started"
    return found


def _cpu_seconds(pids: dict[int, str]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (gone ones left out), by name."""
    seconds = {}
    for pid, name in pids.items():
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            seconds[f"{name} ({pid})"] = times.user + times.system
    return seconds


def _machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy so far (not idle, not waiting on I/O)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


@dataclass(frozen=True)
class ClientWork:
    """What every load-generating process needs to run its share of the clients."""

    url: str
    payloads: list[tuple[str, bytes, float]]  # (file name, bytes, audio seconds) to choose from
    headers: dict[str, str]
    form: dict[str, str]
    request_timeout_s: float
    stop_at: float  # time.monotonic(), the same clock in every process of this machine


def run_clients(work: ClientWork, seeds: list[int]) -> LoadReport:
    """One client thread per seed, each sending one request at a time until ``work.stop_at``: the
    requests' part of a LoadReport."""
    report = LoadReport(len(seeds), 0.0)
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        chooser = random.Random(seed)
        with httpx.Client(timeout=work.request_timeout_s) as http:
            while time.monotonic() < work.stop_at:
                name, data, audio_s = chooser.choice(work.payloads)
                started = time.perf_counter()
                with lock:
                    report.sent += 1
                try:
                    response = http.post(
                        f"{work.url}/v1/audio/transcriptions",
                        headers=work.headers,
                        files={"file": (name, data)},
                        data=work.form,
                    )
                except httpx.HTTPError as error:
                    with lock:
                        report.lost.append(f"{name}: {type(error).__name__}")
                    continue
                with lock:
                    report.answered += 1
                    report.statuses[response.status_code] += 1
                    if response.status_code == 200:
                        report.transcribed.append((audio_s, time.perf_counter() - started))
                        report.server_phases_ms.update(server_timing_ms(response.headers))
                if response.status_code in (429, 503):
                    time.sleep(float(response.headers.get("retry-after", "1")))

    threads = [threading.Thread(target=client_loop, args=(seed,), daemon=True) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return report


def run_load(
    url: str,
    clients: int,
    duration_s: float,
    warmup_s: float,
    api_key: str | None = None,
    request_timeout_s: float = 300.0,
    fields: dict[str, str] | None = None,
    processes: int = 1,
) -> LoadReport:
    """``fields``: vendor form fields sent with every request (e.g. fixed_output_tokens);
    ``processes``: the clients spread over that many processes of their own, so that the load
    generator's own interpreter (one GIL for every client thread) does not slow the clients down
    and count against the server."""
    clips = [c for c in load_manifest(SPEECH_DIR) if c.text]
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    work = ClientWork(
        url,
        [(c.path.name, c.path.read_bytes(), c.duration_s) for c in clips],
        auth,
        {"model": "whisper-1", **(fields or {})},
        request_timeout_s,
        time.monotonic() + duration_s,
    )
    stop_at = work.stop_at
    report = LoadReport(clients, duration_s)
    tokens_at_start = metric_sum(url, "whisper_decoder_tokens_generated", auth)
    pool = (
        concurrent.futures.ThreadPoolExecutor(1)
        if processes == 1
        else concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn")
        )
    )
    shares = [list(range(first, clients, processes)) for first in range(processes)]
    parts = [pool.submit(run_clients, work, seeds) for seeds in shares if seeds]
    time.sleep(min(warmup_s, duration_s))
    serving = _serving_processes()
    measured = {**serving, os.getpid(): "this load generator (the clients)"}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "multiprocessing" in " ".join(child.cmdline()):  # the pool's, not a Ray this process started
                measured[child.pid] = "a load generator process (clients)"
    steady_from, counters_from, cpu_from = time.monotonic(), scrape(url, auth), _cpu_seconds(measured)
    machine_from = _machine_busy_seconds()

    def measure_steady_part() -> None:
        seconds = time.monotonic() - steady_from
        report.steady = steady_figures(counters_from, scrape(url, auth), seconds)
        report.cpu_cores = {
            name: (used - cpu_from[name]) / seconds
            for name, used in _cpu_seconds(measured).items()
            if name in cpu_from
        }
        machine = f"the whole machine ({psutil.cpu_count()} cores)"
        report.cpu_cores[machine] = (_machine_busy_seconds() - machine_from) / seconds

    while not all(part.done() for part in parts):
        if not report.steady and time.monotonic() >= stop_at:
            measure_steady_part()
        for pid, name in serving.items():
            try:
                report.rss_mb.setdefault(f"{name} ({pid})", []).append(
                    psutil.Process(pid).memory_info().rss / 2**20
                )
            except psutil.NoSuchProcess:
                pass
        # Wakes when the clients are done, not at the next sample: the tail is the load's own time.
        timeout_s = min(5.0, max(0.05, stop_at - time.monotonic())) if not report.steady else 5.0
        concurrent.futures.wait(parts, timeout=timeout_s)
    pool.shutdown()
    for part in parts:
        report.absorb(part.result())
    if not report.steady:
        measure_steady_part()
    report.wall_s = time.monotonic() - (stop_at - duration_s)
    time.sleep(2)  # releases of the last pulls are asynchronous
    report.kv_blocks_used_at_end = metric_sum(url, "whisper_decoder_kv_blocks_used", auth)
    report.staged_at_end = metric_sum(url, "whisper_encoder_staged", auth)
    report.tokens_decoded = metric_sum(url, "whisper_decoder_tokens_generated", auth) - tokens_at_start
    return report
