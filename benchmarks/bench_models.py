"""Two models in one app: the default config (configs/default.yaml: tiny.en and base, each with an
encoder and a decoder replica of its own) started on a local Ray. Measures the time from the start
to `/ready` (every model warmed up), each replica's resident memory once ready and after the load,
and a short load split across the two models: clients loop over the speech set's short clips, half
of them on each model, one request at a time each. Prints a table (nothing lost, statuses, and
latency p50/p95 by model); --record appends it to the results log (benchmarks/recording.py) and
writes benchmarks/results/models.json.

    .venv/bin/python benchmarks/bench_models.py [--clients 8] [--duration-s 60] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from tests.support.app_metrics import metric_sum  # noqa: E402
from tests.support.serving import shipped_default_args  # noqa: E402
from tests.support.speech import short_english_clips  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny.en", "base")


def replica_rss_mb() -> dict[str, float]:
    """Resident memory of each Serve replica this process's Ray started (with the processes each
    replica started), by deployment; other sessions' apps on the machine are not this process's
    descendants."""
    import psutil

    from deployments.config import parse_app_config

    config = parse_app_config(shipped_default_args())
    deployments = ["WhisperIngress"] + [
        f"Whisper{side}-{model.deployment_suffix}"
        for model in config.models
        for side in ("Encoder", "Decoder")
    ]

    def rss(process) -> int:
        with contextlib.suppress(psutil.Error):  # a process may end while it is read
            return process.memory_info().rss
        return 0

    found: dict[str, float] = {}
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(process.cmdline())
            # The longest deployment name the title holds (Ray may add the method it runs).
            name = max(
                (d for d in deployments if f"ServeReplica:whisper:{d}" in title), key=len, default=None
            )
            if name is not None:
                started = process.children(recursive=True)
                found[name] = (rss(process) + sum(rss(child) for child in started)) / 2**20
    return dict(sorted(found.items()))


def start_app() -> tuple[str, float, float]:
    """The shipped default app on a local Ray: its URL, the seconds until serve.run returned (every
    replica constructed) and until /ready answered 200 (every model warmed up)."""
    import atexit

    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from tests.support.ports import free_port

    started = time.monotonic()
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    atexit.register(serve.shutdown)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(shipped_default_args()), name="whisper", route_prefix="/")
    deployed_s = time.monotonic() - started
    url = f"http://127.0.0.1:{port}"
    while httpx.get(f"{url}/ready", timeout=60).status_code != 200:
        time.sleep(0.2)
    return url, deployed_s, time.monotonic() - started


def run_load(url: str, clients: int, duration_s: float) -> list[tuple[str, int | None, float]]:
    """Each client on one model (alternating), looping over the short clips until the duration
    ends: (model, status or None for no answer, latency s) per request."""
    import openai

    clips = short_english_clips()
    results: list[tuple[str, int | None, float]] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def client_loop(index: int) -> None:
        model = MODELS[index % len(MODELS)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        for clip in itertools.islice(itertools.cycle(clips), index, None):
            if time.monotonic() > deadline:
                return
            sent = time.perf_counter()
            try:
                with open(clip.path, "rb") as audio:
                    client.audio.transcriptions.create(model=model, file=audio)
                status = 200
            except openai.APIStatusError as error:
                status = error.status_code
            except openai.APIError:
                status = None  # no answer: lost
            with lock:
                results.append((model, status, time.perf_counter() - sent))

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    return results


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, half on each model")
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    url, deployed_s, ready_s = start_app()
    rss_ready = replica_rss_mb()
    results = run_load(url, args.clients, args.duration_s)
    rss_after = replica_rss_mb()
    kv_blocks_used = metric_sum(url, "whisper_decoder_kv_blocks_used")

    lost = sum(1 for _, status, _ in results if status is None)
    rows = [
        ["seconds from start to every replica constructed (serve.run)", round(deployed_s, 1)],
        ["seconds from start to /ready (every model warmed up)", round(ready_s, 1)],
        ["clients (half on each model)", args.clients],
        ["load duration s", args.duration_s],
        ["requests", len(results)],
        ["lost (no answer)", lost],
        ["KV blocks used at end", kv_blocks_used],
    ]
    model_rows = []
    for model in MODELS:
        mine = [(status, latency) for name, status, latency in results if name == model]
        answered = [latency for status, latency in mine if status == 200]
        statuses = {}
        for status, _ in mine:
            statuses[status] = statuses.get(status, 0) + 1
        model_rows.append(
            [
                model,
                len(mine),
                str(dict(sorted(statuses.items(), key=lambda item: str(item[0])))),
                round(percentile(answered, 0.5), 2),
                round(percentile(answered, 0.95), 2),
            ]
        )
    rss_rows = [[name, round(mb), round(rss_after.get(name, float("nan")))] for name, mb in rss_ready.items()]
    table = (
        markdown_table(["figure", "value"], rows)
        + "\n\n"
        + markdown_table(["model", "requests", "statuses", "latency p50 s", "latency p95 s"], model_rows)
        + "\n\n"
        + markdown_table(["replica", "RSS MB once ready", "RSS MB after the load"], rss_rows)
    )
    print(table)
    if args.record:
        record(
            "Two models in one app, default config on CPU (bench_models.py)",
            table,
            "Clients loop over the speech set's short English clips, one request at a time each; "
            "even-numbered clients send model=tiny.en, odd ones model=base. RSS includes the processes "
            "a replica started.",
            json_path=ROOT / "benchmarks" / "results" / "models.json",
            metrics={
                "deployed_s": deployed_s,
                "ready_s": ready_s,
                "requests": len(results),
                "lost_requests": lost,
                "kv_blocks_used_at_end": kv_blocks_used,
                "by_model": {
                    row[0]: {"requests": row[1], "p50_s": row[3], "p95_s": row[4]} for row in model_rows
                },
                "rss_mb_ready": rss_ready,
                "rss_mb_after": rss_after,
            },
        )


if __name__ == "__main__":
    main()
