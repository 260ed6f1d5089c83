"""What diarization costs the served app (issue 66's benchmark), the diarizer on a replica of its
own as configs/default.yaml ships it:

1. latency of a 5-minute two-speaker recording (tests/support/conversations.py) answered plain
   (json), with word timestamps (verbose_json: the decoding a diarized request asks for) and
   diarized (diarized_json); each the median of --repeats, the three kinds taking turns; and the
   Server-Timing phase ``speakers``: how long a diarized answer waited for the diarizer after its
   windows were done; the phase ``windows`` (the transcription's own time); and the CPU seconds
   the app's processes spent during each request, the diarizer's replica apart;
2. throughput of a load of --requests one-minute two-speaker conversations sent by --clients
   clients at once, with none diarized and then with every third one diarized.

    .venv/bin/python benchmarks/bench_diarize_served.py [--repeats 2] [--clients 3] [--requests 12]
        [--diarizer-threads 1] [--diarizer-core 1] [--record]

--diarizer-core N gives the diarizer's replica core N alone and every other process of the app (and
this client) the other cores, as on a machine where the diarizer's replica has CPUs of its own: the
issue's goal (a diarized request within 1.2x of a plain one) is for that case.

Starts a local Ray and the default model of configs/default.yaml (tiny.en) as a one-model app with
its diarizer. Prints the tables; --record appends them to the results log.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from tests.support.app_metrics import scrape, server_timing_ms  # noqa: E402
from tests.support.conversations import conversation  # noqa: E402
from tests.support.encoding import UploadFormat, encode  # noqa: E402
from tests.support.serving import default_app_args, running_app  # noqa: E402

SAMPLE_RATE = 16000
WAV = UploadFormat("wav-16bit", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE)
_IDLE_S = 10.0
KINDS = {
    "plain (json)": "json",
    "word timestamps (verbose_json)": "verbose_json",
    "diarized": "diarized_json",
}


def _send(url: str, upload: bytes, response_format: str) -> tuple[float, dict[str, float]]:
    data = {"model": "whisper-1", "response_format": response_format}
    if response_format == "verbose_json":
        data["timestamp_granularities[]"] = "word"
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/audio/transcriptions", data=data, files={"file": ("talk.wav", upload)}, timeout=1800
    )
    elapsed_s = time.perf_counter() - started
    response.raise_for_status()
    return elapsed_s, server_timing_ms(response.headers)


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 600
    while httpx.get(f"{url}/ready", timeout=60).status_code != 200:
        if time.monotonic() > deadline:
            raise SystemExit("the app did not get ready in 10 minutes")
        time.sleep(0.5)


def _give_the_diarizer_its_own_core(core: int) -> str:
    """Pins the diarizer's replica (and any process it started) to ``core`` and this process and
    every other process of the app's local Ray (its children: GCS, raylet, the replicas, and the
    processes they start later, which inherit the mask) to the other cores."""
    import psutil

    others = sorted(set(range(os.cpu_count() or 1)) - {core})
    if not others:
        raise SystemExit("--diarizer-core needs a machine of two cores or more")
    here = psutil.Process()
    diarizers = [p for p in here.children(recursive=True) if "Diarizer" in " ".join(p.cmdline())]
    if not diarizers:
        raise SystemExit("no diarizer replica among the app's processes")
    theirs = {p.pid for d in diarizers for p in [d, *d.children(recursive=True)]}
    for process in [here, *here.children(recursive=True)]:
        cores = {core} if process.pid in theirs else set(others)
        # Every thread, not only the process's main one (all that sched_setaffinity on a process id,
        # and so psutil's cpu_affinity, pins): a replica runs its requests on threads started
        # before this (its event loop's, the worker threads its warm-up call started), and a
        # thread left unpinned runs, and starts threads that run, on every core.
        for thread in process.threads():
            try:
                os.sched_setaffinity(thread.id, cores)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
    return f"the diarizer's replica on core {core}; the rest of the app and the client on cores {others}"


class _AppProcesses:
    """The app's processes (this client's children: Ray's and the replicas'), the diarizer's
    replica apart, for the CPU time each side spends on a request."""

    def __init__(self):
        import psutil

        self._processes = psutil.Process().children(recursive=True)
        diarizers = [p for p in self._processes if "Diarizer" in " ".join(p.cmdline())]
        self._diarizer_pids = {p.pid for d in diarizers for p in [d, *d.children(recursive=True)]}

    def cpu_seconds(self) -> tuple[float, float]:
        """(the rest of the app's, the diarizer's) CPU seconds so far."""
        import psutil

        rest, diarizer = 0.0, 0.0
        for process in self._processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            if process.pid in self._diarizer_pids:
                diarizer += times.user + times.system
            else:
                rest += times.user + times.system
        return rest, diarizer


def _latency(url: str, repeats: int) -> str:
    talk = conversation("two_speakers_5min", ["osr", "multi_en"], 300.0, seed=5)
    upload = encode(talk.samples, WAV)
    _send(url, upload, "diarized_json")  # first calls: the diarizer's clustering imports, caches
    processes = _AppProcesses()
    # Ray's own processes spend CPU while nothing is asked of them (heartbeats, metrics, the
    # controller's loop): measured here, and taken off each request's figures for its duration, so
    # that a request that waits longer is not charged for the app idling meanwhile.
    idle_rest, idle_diarizer = processes.cpu_seconds()
    idle_started = time.perf_counter()
    time.sleep(_IDLE_S)
    idle_s = time.perf_counter() - idle_started
    rest_now, diarizer_now = processes.cpu_seconds()
    idle_rate = ((rest_now - idle_rest) / idle_s, (diarizer_now - idle_diarizer) / idle_s)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    windows_s: dict[str, list[float]] = {kind: [] for kind in KINDS}
    app_cpu_s: dict[str, list[float]] = {kind: [] for kind in KINDS}
    diarizer_cpu_s: dict[str, list[float]] = {kind: [] for kind in KINDS}
    waits_ms: list[float] = []
    for repeat in range(repeats):
        order = list(KINDS)[repeat % len(KINDS) :] + list(KINDS)[: repeat % len(KINDS)]
        for kind in order:
            rest_before, diarizer_before = processes.cpu_seconds()
            elapsed_s, phases = _send(url, upload, KINDS[kind])
            rest_after, diarizer_after = processes.cpu_seconds()
            times[kind].append(elapsed_s)
            windows_s[kind].append(phases.get("windows", 0.0) / 1000)
            app_cpu_s[kind].append(rest_after - rest_before - idle_rate[0] * elapsed_s)
            diarizer_cpu_s[kind].append(diarizer_after - diarizer_before - idle_rate[1] * elapsed_s)
            if KINDS[kind] == "diarized_json":
                waits_ms.append(phases.get("speakers", 0.0))
    plain_s = statistics.median(times["plain (json)"])
    words_s = statistics.median(times["word timestamps (verbose_json)"])
    rows = []
    for kind, values in times.items():
        median_s = statistics.median(values)
        rows.append(
            [
                kind,
                round(talk.duration_s),
                median_s,
                min(values),
                median_s / plain_s,
                median_s / words_s,
                statistics.median(windows_s[kind]),
                statistics.median(app_cpu_s[kind]),
                statistics.median(diarizer_cpu_s[kind]),
            ]
        )
    table = markdown_table(
        [
            "request",
            "audio s",
            "median s",
            "fastest s",
            "/ plain",
            "/ word timestamps",
            "windows s",
            "CPU s, app without diarizer",
            "CPU s, diarizer",
        ],
        rows,
    )
    return (
        table + f"\n\nA diarized answer waited for the diarizer after its windows: median "
        f"{statistics.median(waits_ms) / 1000:.2f} s (Server-Timing `speakers`). `windows s`: the "
        "Server-Timing phase from the audio decoded to the last window transcribed (medians); CPU "
        "seconds of the app's processes during the request (Ray's own included), the diarizer's "
        f"replica apart, less what they spent idle for as long ({idle_rate[0]:.2f} and "
        f"{idle_rate[1]:.2f} CPU s a second, measured over {_IDLE_S:.0f} s with no request)."
    )


def _throughput(url: str, clients: int, requests: int) -> str:
    calls = [
        conversation(f"call_{seed}", ["jfk", "tts_f2"], 60.0, seed=seed)
        for seed in range(11, 11 + min(requests, 4))
    ]
    uploads = [encode(call.samples, WAV) for call in calls]
    audio_s = [call.duration_s for call in calls]
    rows = []
    for label, diarized_every in (("none diarized", 0), ("a third diarized", 3)):
        plan = [
            (
                index % len(uploads),
                "diarized_json" if diarized_every and index % diarized_every == 0 else "json",
            )
            for index in range(requests)
        ]
        before = scrape(url)
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            latencies = list(pool.map(lambda item: _send(url, uploads[item[0]], item[1])[0], plan))
        wall_s = time.perf_counter() - started
        after = scrape(url)
        total_audio_s = sum(audio_s[upload] for upload, _ in plan)
        diarized_s = after.get("whisper_diarizer_audio_seconds", 0) - before.get(
            "whisper_diarizer_audio_seconds", 0
        )
        rows.append(
            [
                label,
                requests,
                round(total_audio_s),
                round(diarized_s),
                wall_s,
                requests / wall_s,
                total_audio_s / wall_s,
                statistics.median(latencies),
                max(latencies),
            ]
        )
    return markdown_table(
        [
            "load",
            "requests",
            "audio s",
            "audio s diarized",
            "wall s",
            "requests / s",
            "audio s / wall s",
            "median latency s",
            "slowest s",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--diarizer-threads", type=int, default=None, help="the diarizer's torch threads")
    parser.add_argument(
        "--diarizer-core", type=int, default=None, help="pin the diarizer's replica to this core alone"
    )
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    app_args = default_app_args()
    if args.diarizer_threads is not None:
        app_args["diarizer"] = {**app_args["diarizer"], "torch_threads": args.diarizer_threads}
    with running_app(app_args) as url:
        _wait_ready(url)
        pinning = ""
        if args.diarizer_core is not None:
            pinning = _give_the_diarizer_its_own_core(args.diarizer_core)
            print(pinning)
        tables = [
            ("Latency of a 5-minute two-speaker recording", _latency(url, args.repeats)),
            (
                f"Throughput: {args.requests} one-minute conversations, {args.clients} clients at once",
                _throughput(url, args.clients, args.requests),
            ),
        ]
    body = titled_tables(tables)
    if pinning:
        body = f"Cores: {pinning}.\n\n{body}"
    # Other work on the machine slows every row: the load says how much there was.
    body += (
        f"\n\nThe machine's load average (1 min) was {load_before:.1f} before the app started and "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores."
    )
    print(body)
    if args.record:
        record("Diarization in the served app: latency and mixed load (bench_diarize_served.py)", body)


if __name__ == "__main__":
    main()
