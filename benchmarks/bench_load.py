"""Load test of the serving app: many concurrent clients for minutes; every request must get a
final answer, no 5xx but the designed 429/503, every process's memory flat after warm-up, and
the KV pool all free at the end.

    .venv/bin/python benchmarks/bench_load.py [--clients 64] [--processes 1] [--duration-s 300] [--record]
        [--fixed-output-tokens N] [--no-fallback] [--priority interactive|batch]

Starts a local Ray and the default app (configs/default.yaml) unless --url points at a running one.
The vendor fields let random weights be measured: ``--fixed-output-tokens`` makes every window
decode exactly N tokens (the server's benchmark-only ``fixed_output_tokens``, which a server accepts
only with ``http.benchmark_fields: true``: the app started here has it on; a server at --url needs
it in its config). Tokens/s comes from the decoders' own counters
(``whisper_decoder_tokens_generated`` at /metrics).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import multiprocessing
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.local_ports import free_port  # noqa: E402
from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.transcribe.evaluation import load_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEECH_DIR = ROOT / "tests" / "data" / "speech"
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


def metric_sum(url: str, prefix: str) -> float:
    """The sum over replicas of one Prometheus metric the app exports at /metrics."""
    return scrape(url).get(prefix, 0.0)


def scrape(url: str) -> dict[str, float]:
    """/metrics as sums over replicas: by metric name, and by name and stage label
    (``name[stage]``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums: dict[str, float] = {}
    for sample in _SAMPLE.finditer(text):
        name, labels, value = sample.groups()
        stage = _STAGE.search(labels)
        for key in (name, f"{name}[{stage.group(1)}]" if stage else None):
            if key is not None:
                sums[key] = sums.get(key, 0.0) + float(value)
    return sums


_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$", re.MULTILINE)
_STAGE = re.compile(r'stage="(\w+)"')


def server_timing_ms(headers) -> dict[str, float]:
    """The phases of a ``Server-Timing`` header (``name;dur=ms, ...``)."""
    phases = {}
    for entry in headers.get("server-timing", "").split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if name and duration:
            phases[name] = float(duration)
    return phases


def steady_figures(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """What the app's counters say about an interval: throughput, the decode batch and step, and
    where a window's time went (means per window, in seconds)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    steps, windows = delta("whisper_decoder_steps"), delta("whisper_decoder_windows_timed")
    encoded = delta("whisper_encoder_windows_encoded")
    return {
        "tokens_per_s": ratio(delta("whisper_decoder_tokens_generated"), seconds),
        "decode_batch": ratio(delta("whisper_decoder_rows_stepped"), steps),
        "step_ms": 1000 * ratio(delta("whisper_decoder_loop_busy_seconds"), steps),
        "read_wait_ms": 1000 * ratio(delta("whisper_decoder_read_wait_seconds"), steps),
        "decoder_busy": ratio(delta("whisper_decoder_loop_busy_seconds"), seconds),
        "encoder_batch": ratio(encoded, delta("whisper_encoder_batches")),
        "encoder_busy": ratio(delta("whisper_encoder_busy_seconds"), seconds),
        "encoder_queued_s": ratio(delta("whisper_encoder_window_seconds[queued]"), encoded),
        "encoder_forward_s": ratio(delta("whisper_encoder_window_seconds[forward]"), encoded),
        "forward_s": ratio(delta("whisper_encoder_busy_seconds"), delta("whisper_encoder_batches")),
        "forward_worker_s": ratio(
            delta("whisper_encoder_forward_seconds[worker]"), delta("whisper_encoder_batches")
        ),
        # Measured by a colocated replica only: absent, it is unknown, not zero.
        "forward_gpu_wait_s": ratio(
            delta("whisper_encoder_forward_seconds[gpu_wait]"), delta("whisper_encoder_batches")
        )
        if "whisper_encoder_forward_seconds[gpu_wait]" in after
        else float("nan"),
        "decoder_queued_s": ratio(delta("whisper_decoder_window_seconds[queued]"), windows),
        "kv_loading_s": ratio(delta("whisper_decoder_window_seconds[loading]"), windows),
        "decoding_s": ratio(delta("whisper_decoder_window_seconds[decoding]"), windows),
        "kv_worker_queue_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[worker_queue]"), windows),
        "kv_pull_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[pull]"), windows),
        "kv_pickup_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[pickup]"), windows),
        "seconds": seconds,
    }


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
    work = ClientWork(
        url,
        [(c.path.name, c.path.read_bytes(), c.duration_s) for c in clips],
        {"Authorization": f"Bearer {api_key}"} if api_key else {},
        {"model": "whisper-1", **(fields or {})},
        request_timeout_s,
        time.monotonic() + duration_s,
    )
    stop_at = work.stop_at
    report = LoadReport(clients, duration_s)
    tokens_at_start = metric_sum(url, "whisper_decoder_tokens_generated")
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
    steady_from, counters_from, cpu_from = time.monotonic(), scrape(url), _cpu_seconds(measured)
    machine_from = _machine_busy_seconds()

    def measure_steady_part() -> None:
        seconds = time.monotonic() - steady_from
        report.steady = steady_figures(counters_from, scrape(url), seconds)
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
        time.sleep(min(5.0, max(0.05, stop_at - time.monotonic())) if not report.steady else 5.0)
    pool.shutdown()
    for part in parts:
        report.absorb(part.result())
    if not report.steady:
        measure_steady_part()
    report.wall_s = time.monotonic() - (stop_at - duration_s)
    time.sleep(2)  # releases of the last pulls are asynchronous
    report.kv_blocks_used_at_end = metric_sum(url, "whisper_decoder_kv_blocks_used")
    report.staged_at_end = metric_sum(url, "whisper_encoder_staged")
    report.tokens_decoded = metric_sum(url, "whisper_decoder_tokens_generated") - tokens_at_start
    return report


def steady_rows(steady: dict[str, float]) -> list[list]:
    """The table rows of steady_figures(): what the app's counters saw between warm-up and stop."""
    if not steady:
        return []
    ms = {key: round(1000 * steady[key], 1) for key in steady if key.endswith("_s") and key != "seconds"}
    return [
        ["steady s (warm-up end to stop)", round(steady["seconds"], 1)],
        ["steady tokens/s (decoder counters)", round(steady["tokens_per_s"], 1)],
        [
            "steady decode batch (rows a step) / step ms (of it, reading tokens back)",
            f"{steady['decode_batch']:.1f} / {steady['step_ms']:.2f} ({steady['read_wait_ms']:.2f})",
        ],
        [
            "steady decode loop busy / encoder busy",
            f"{steady['decoder_busy']:.0%} / {steady['encoder_busy']:.0%}",
        ],
        ["steady encoder batch", round(steady["encoder_batch"], 2)],
        [
            "a window's ms: encoder queue, forward; decoder queue, K/V load, decoding",
            f"{ms['encoder_queued_s']}, {ms['encoder_forward_s']}; {ms['decoder_queued_s']}, "
            f"{ms['kv_loading_s']}, {ms['decoding_s']}",
        ],
        [
            "of the K/V load, ms: waiting for a loader worker, pulling, waiting for the loop",
            f"{ms['kv_worker_queue_s']}, {ms['kv_pull_s']}, {ms['kv_pickup_s']}",
        ],
        [
            "a forward's ms: all, on its worker thread, of that waiting for the GPU (colocated)",
            f"{ms['forward_s']}, {ms['forward_worker_s']}, {ms['forward_gpu_wait_s']}",
        ],
    ]


def server_phase_rows(report: LoadReport) -> list[list]:
    """Mean ms of each ingress phase, and of the rest of a request's latency as its client saw it
    (the HTTP proxy, the network, the client itself)."""
    answered = len(report.transcribed)
    if not answered or not report.server_phases_ms:
        return []
    means = {phase: total / answered for phase, total in report.server_phases_ms.items()}
    outside = 1000 * sum(report.latencies_s()) / answered - sum(means.values())
    return [
        [
            "a request's mean ms in the ingress: " + ", ".join(means),
            ", ".join(f"{ms:.1f}" for ms in means.values()),
        ],
        ["a request's mean ms outside the ingress (proxy, network, client)", round(outside, 1)],
    ]


def start_default_app(cpu_dtype: str | None = None, benchmark_fields: bool = False) -> str:
    import ray
    import yaml
    from ray import serve

    from deployments.app import build_app

    spec = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())["applications"][0]
    if cpu_dtype:
        spec["args"]["engine"]["cpu_dtype"] = cpu_dtype
    if benchmark_fields:  # the server accepts the benchmark-only request fields
        spec["args"]["http"] = {**spec["args"].get("http", {}), "benchmark_fields": True}
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    # Before Ray's own shutdown at exit (registered earlier, so it runs later): Serve stops what it
    # started outside Ray's workers, such as HAProxy (README, "Behind HAProxy").
    atexit.register(serve.shutdown)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"])
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", help="a running server; default: start configs/default.yaml here")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="spread the clients over this many processes (a server's clients are not one interpreter)",
    )
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--warmup-s", type=float, default=30)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--fixed-output-tokens", type=int, default=None, help="every window decodes N tokens")
    parser.add_argument("--no-fallback", action="store_true", help="send temperature_fallback=false")
    parser.add_argument("--priority", choices=["interactive", "batch"], default=None)
    parser.add_argument(
        "--cpu-dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="engine.cpu_dtype of the app",
    )
    args = parser.parse_args()
    fields = {}
    if args.fixed_output_tokens:
        fields["fixed_output_tokens"] = str(args.fixed_output_tokens)
    if args.no_fallback:
        fields["temperature_fallback"] = "false"
    if args.priority:
        fields["priority"] = args.priority
    url = args.url or start_default_app(args.cpu_dtype, benchmark_fields=bool(args.fixed_output_tokens))
    report = run_load(
        url,
        args.clients,
        args.duration_s,
        args.warmup_s,
        args.api_key,
        fields=fields,
        processes=args.processes,
    )
    rows = [
        ["clients", report.clients],
        ["load-generating processes", args.processes],
        ["duration s", report.duration_s],
        ["requests sent", report.sent],
        ["answered", report.answered],
        ["lost (no answer)", len(report.lost)],
        ["statuses", dict(sorted(report.statuses.items()))],
        ["unexpected 5xx", report.unexpected_5xx],
        ["audio s transcribed", round(report.audio_s, 1)],
        ["wall s (to the last answer)", round(report.wall_s, 1)],
        ["throughput (audio s / wall s)", round(report.audio_s / report.wall_s, 2)],
        ["latency mean s", round(sum(report.latencies_s()) / max(1, len(report.transcribed)), 3)],
        ["latency p50 s", round(report.percentile_s(0.5), 2)],
        ["latency p95 s", round(report.percentile_s(0.95), 2)],
        ["latency p50 s, clips over 30 s", round(report.percentile_s(0.5, "long"), 2)],
        [
            "latency p50 / p95 s, clips up to 30 s",
            " / ".join(str(round(report.percentile_s(q, "short"), 2)) for q in (0.5, 0.95)),
        ],
        ["tokens decoded / wall s (decoder counters)", round(report.tokens_per_s, 1)],
        *steady_rows(report.steady),
        *server_phase_rows(report),
        ["vendor fields", fields or "none"],
        ["engine.cpu_dtype", args.cpu_dtype or ("the server's" if args.url else "default (auto)")],
        ["max RSS growth after warm-up", f"{report.max_rss_growth:.1%}"],
        ["KV blocks used at end", report.kv_blocks_used_at_end],
        ["staged K/V at end", report.staged_at_end],
    ]
    rss_rows = [
        [name, round(s[0]), round(s[-1]), f"{(s[-1] - s[0]) / s[0]:.1%}"]
        for name, s in report.rss_mb.items()
        if s
    ]
    cpu_rows = [[name, f"{cores:.2f}"] for name, cores in sorted(report.cpu_cores.items())]
    table = (
        markdown_table(["figure", "value"], rows)
        + "\n\n"
        + markdown_table(["process", "RSS MB after warm-up", "RSS MB at end", "growth"], rss_rows)
        + "\n\n"
        + markdown_table(["process", "cores busy over the steady part"], cpu_rows)
    )
    print(table)
    if report.lost:
        print("lost:", report.lost[:10])
    if args.record:
        metrics = {
            "clients": report.clients,
            "duration_s": report.duration_s,
            "sent": report.sent,
            "answered": report.answered,
            "lost_requests": len(report.lost),
            "unexpected_5xx": report.unexpected_5xx,
            "statuses": {str(k): v for k, v in report.statuses.items()},
            "max_rss_growth": report.max_rss_growth,
            "latency_p50_s": report.percentile_s(0.5),
            "latency_p95_s": report.percentile_s(0.95),
            "latency_p95_s_clips_up_to_30_s": report.percentile_s(0.95, "short"),
            "kv_blocks_used_at_end": report.kv_blocks_used_at_end,
            "staged_at_end": report.staged_at_end,
            "tokens_per_s": report.tokens_per_s,
            "steady": report.steady,
        }
        record(
            "Load test, default app on CPU (bench_load.py)",
            table,
            "Clients loop over the 42 English clips of the speech set, one request at a time each.",
            json_path=ROOT / "benchmarks" / "results" / "load.json",
            metrics=metrics,
        )


if __name__ == "__main__":
    main()
