"""What a Ray Serve call costs.

1. The replica that answers it: CPU time per call of a method that does nothing, in the replica's
   process (its event loop and Serve's request handling), with Serve's access log on and off. A
   decoder replica's decode loop shares that process and its GIL (issue 20).
2. A window's samples as the call's argument, as the ingress sends them to an encoder or decoder
   replica: through Ray's object store (Ray's limit for arguments inside a call is 100 KB) against
   inside the call (``http.inline_window_kb`` at 512, the ingress's environment as deployments/app.py
   sets it). Closed-loop callers in a caller replica, side by side in one Ray; calls/s, latency, and the
   answering replica's CPU per call.

    .venv/bin/python benchmarks/bench_serve_call.py [--calls 2000] [--rounds 3] [--window-s 2,5,8,15,30]
        [--callers 16] [--seconds 5] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

import numpy as np
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from deployments.config import HTTPLimits  # noqa: E402
from engine.model.audio import SAMPLE_RATE  # noqa: E402


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# No CPUs reserved: four replicas must fit a 2-core machine.
@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Echo:
    async def call(self, value: int) -> int:
        return value

    async def window(self, samples: np.ndarray) -> int:
        return len(samples)

    def cpu_s(self) -> float:
        return _cpu_s()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, echo):
        self.echo = echo

    async def run(self, calls: int) -> tuple[float, float]:
        """(replica CPU µs per call, calls per second), ``calls`` at once."""
        before = await self.echo.cpu_s.remote()
        started = time.perf_counter()
        await asyncio.gather(*[self.echo.call.remote(i) for i in range(calls)])
        wall_s = time.perf_counter() - started
        after = await self.echo.cpu_s.remote()
        return (after - before) / calls * 1e6, calls / wall_s

    async def windows(self, window_s: float, callers: int, seconds: float) -> dict:
        """``callers`` closed-loop callers sending a ``window_s`` window each call for ``seconds``."""
        samples = np.random.default_rng(0).standard_normal(int(window_s * SAMPLE_RATE)).astype(np.float32)
        latencies: list[float] = []
        before = await self.echo.cpu_s.remote()
        stop_at = time.perf_counter() + seconds

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                await self.echo.window.remote(samples)
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*[caller() for _ in range(callers)])
        cpu_s = await self.echo.cpu_s.remote() - before
        latencies.sort()
        return {
            "calls_per_s": len(latencies) / seconds,
            "mean_ms": 1e3 * sum(latencies) / len(latencies),
            "p95_ms": 1e3 * latencies[int(0.95 * len(latencies))],
            "replica_cpu_us": 1e6 * cpu_s / len(latencies),
        }


def empty_calls(calls: int, rounds: int) -> None:
    print("| access log | replica CPU µs per call (best of rounds) | calls/s |")
    print("|---|---|---|")
    for access_log in (True, False):
        echo = Echo.options(logging_config={"enable_access_log": access_log}).bind()
        caller = serve.run(Caller.bind(echo), name="serve-call", route_prefix=None)
        caller.run.remote(200).result()  # warm-up
        cpu_us, rate = min(caller.run.remote(calls).result() for _ in range(rounds))
        print(f"| {'on' if access_log else 'off'} | {cpu_us:.0f} | {rate:.0f} |", flush=True)
        serve.delete("serve-call")


@serve.deployment(ray_actor_options={"num_cpus": 0})
class _Pair:
    def __init__(self, store, inline):
        self.ways = {"store": store, "inline": inline}

    async def windows(self, way: str, window_s: float, callers: int, seconds: float) -> dict:
        return await self.ways[way].windows.remote(window_s, callers, seconds)


WINDOW_HEADERS = [
    "window s (KB)",
    "calls/s: store / inline",
    "inline / store",
    "mean ms: store / inline",
    "p95 ms: store / inline",
    "answering replica's CPU µs a call: store / inline",
]


def window_calls(window_s: list[float], callers: int, seconds: float) -> list[list[str]]:
    echo = Echo.bind()
    store = Caller.options(name="CallerThroughTheStore").bind(echo)
    inline_env = HTTPLimits(inline_window_kb=512).ingress_runtime_env()
    inline = Caller.options(name="CallerInline", ray_actor_options={"num_cpus": 0, "runtime_env": inline_env})
    # Both callers in one app, answered by the same replica: the two ways alternate in one Ray.
    app = serve.run(_Pair.bind(store, inline.bind(echo)), name="window-calls", route_prefix=None)
    rows = []
    for seconds_of_audio in window_s:
        results = {}
        for way in ("store", "inline"):
            app.windows.remote(way, seconds_of_audio, callers, 1.0).result()  # warm-up
            results[way] = app.windows.remote(way, seconds_of_audio, callers, seconds).result()
        store_r, inline_r = results["store"], results["inline"]
        rows.append(
            [
                f"{seconds_of_audio:g} ({4 * seconds_of_audio * SAMPLE_RATE / 1024:.0f})",
                f"{store_r['calls_per_s']:.0f} / {inline_r['calls_per_s']:.0f}",
                f"{inline_r['calls_per_s'] / store_r['calls_per_s']:.2f}x",
                f"{store_r['mean_ms']:.1f} / {inline_r['mean_ms']:.1f}",
                f"{store_r['p95_ms']:.1f} / {inline_r['p95_ms']:.1f}",
                f"{store_r['replica_cpu_us']:.0f} / {inline_r['replica_cpu_us']:.0f}",
            ]
        )
    serve.delete("window-calls")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", default="2,5,8,15,30", help="window lengths for part 2, seconds")
    parser.add_argument("--callers", type=int, default=16, help="closed-loop callers for part 2")
    parser.add_argument("--seconds", type=float, default=5.0, help="each part-2 run's length")
    parser.add_argument("--part", choices=("empty", "windows", "both"), default="both")
    parser.add_argument("--record", action="store_true", help="append part 2's table to RESULTS.md")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    if args.part in ("empty", "both"):
        empty_calls(args.calls, args.rounds)
    if args.part in ("windows", "both"):
        rows = window_calls([float(s) for s in args.window_s.split(",")], args.callers, args.seconds)
        print(markdown_table(WINDOW_HEADERS, rows))
        if args.record:
            record(
                "A window's samples in a Serve call: through Ray's object store or inside the call",
                markdown_table(WINDOW_HEADERS, rows),
                f"{args.callers} closed-loop callers in one caller replica, {args.seconds:g} s a run, "
                "one answering replica; the two ways alternate in one Ray",
            )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
