"""What one Ray Serve call costs the replica that answers it: CPU time per call of a method that does
nothing, in the replica's process (its event loop and Serve's request handling), with Serve's access
log on and off. A decoder replica's decode loop shares that process and its GIL (issue 20).

    .venv/bin/python benchmarks/bench_serve_call.py [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import ray
from ray import serve


@serve.deployment(max_ongoing_requests=1000)
class Echo:
    async def call(self, value: int) -> int:
        return value

    def cpu_s(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


@serve.deployment
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    print("| access log | replica CPU µs per call (best of rounds) | calls/s |")
    print("|---|---|---|")
    for access_log in (True, False):
        echo = Echo.options(logging_config={"enable_access_log": access_log}).bind()
        caller = serve.run(Caller.bind(echo), name="serve-call", route_prefix=None)
        caller.run.remote(200).result()  # warm-up
        rounds = [caller.run.remote(args.calls).result() for _ in range(args.rounds)]
        cpu_us, rate = min(rounds)
        print(f"| {'on' if access_log else 'off'} | {cpu_us:.0f} | {rate:.0f} |", flush=True)
        serve.delete("serve-call")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
