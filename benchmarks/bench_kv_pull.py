"""Cross-attention K/V pulls over NIXL into a decoder's paged cache, beside a host-bound loop, as in
a decoder replica: how long a pull takes (start to landing), how many land a second, and how much
the pulls slow the loop.

A sender process stages windows of the model's K/V shape as fast as its staging lets it (an
encoder replica's NixlSender); this process pulls them through the engine's own CrossKVLoader into
a PagedKVStorage, a few at a time, while a thread runs a stand-in for the decode loop (a step of
small device operations and Python work, the way a decoder replica's loop is bound by its host).
Each tree in ``--trees`` (this one, or another checkout's engine/ and kv_transfer/) runs in a
process of its own, in turns, ``--rounds`` times.

    python benchmarks/bench_kv_pull.py [--shape large-v3-turbo] [--sender-device cuda:0] \
        [--receiver-device cuda:1] [--pulls 300] [--rate 100] [--staged-poll-ms 5] \
        [--trees .,/tmp/other] [--rounds 2] [--record]

``--rate`` starts that many pulls a second (as a replica admits windows) instead of as many as fit;
``--staged-poll-ms`` sets the sender's transfer.staged_poll_interval_ms where the tree has it.

Prints a row per tree and round (pull p50/p95 ms, pulls landed a second, the loop's steps a second
with and without pulls); --record appends the table to the results log (benchmarks/recording.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

# decoder layers, heads, head dim of each shape's cross-attention K/V
SHAPES = {"large-v3": (32, 20, 64), "large-v3-turbo": (4, 20, 64), "tiny": (4, 6, 64)}
FRAMES = 1500
BLOCK_SIZE = 128
IN_FLIGHT = 8  # windows admitted and loading at once, at most


def _sender(tree: str, device: str, shape: str, pulls: int, staged_poll_ms: float | None, handles) -> None:
    """The encoder side: stage ``pulls`` windows, each as soon as staging has room."""
    sys.path.insert(0, tree)
    import torch

    from kv_transfer import make_sender
    from kv_transfer.config import TransferConfig

    layers, heads, head_dim = SHAPES[shape]
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    window = torch.randn(layers, 2, FRAMES, heads, head_dim, dtype=dtype, device=device)
    settings = dict(connector="nixl", staging_memory_mb=4096, stage_wait_s=60)
    if staged_poll_ms is not None and "staged_poll_interval_ms" in TransferConfig.model_fields:
        settings["staged_poll_interval_ms"] = staged_poll_ms
    config = TransferConfig(**settings)
    sender = make_sender(config, block_size=BLOCK_SIZE, device=device)
    for index in range(pulls):
        handles.put(sender.stage(f"window-{index}", window, "cross_kv"))
    handles.put(None)
    while sender.num_staged:  # until every window is pulled and released
        time.sleep(0.01)
    sender.close()


class StandInLoop:
    """A decode loop bound by its host: each step launches small device operations and does
    Python work for each of its rows, then waits for the device, as a replica's loop does."""

    def __init__(self, device, rows: int = 64, operations: int = 60):
        import torch

        self.torch = torch
        self.device = device
        self.rows = rows
        self.operations = operations
        self.state = torch.zeros(rows, 64, device=device)
        self.step_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-loop", daemon=True)

    def _step(self) -> None:
        for _ in range(self.operations):
            self.state.add_(1.0)
        bookkeeping = {}
        for row in range(self.rows):  # per-row work: tokens appended, stop rules checked
            bookkeeping[row] = [row, row * 2, str(row)]
        if self.device.type == "cuda":
            self.torch.cuda.current_stream(self.device).synchronize()

    def _timed_step(self) -> None:
        started = time.perf_counter()
        self._step()
        self.step_s.append(time.perf_counter() - started)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._timed_step()

    def measure(self, seconds: float) -> float:
        """The median step time over ``seconds`` of the loop running alone."""
        self.step_s.clear()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            self._timed_step()
        return statistics.median(self.step_s)

    def start(self) -> None:
        self.step_s.clear()
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return statistics.median(self.step_s)


def run_one(tree: str, args: argparse.Namespace) -> dict:
    """One tree's run, in this process: the figures as a dict."""
    shape, pulls = args.shape, args.pulls
    sys.path.insert(0, tree)
    import torch

    from engine.decode.kv_loader import CrossKVLoader
    from engine.kv.block_pool import BlockPool
    from engine.kv.storage import PagedKVStorage
    from kv_transfer import make_receiver
    from kv_transfer.config import TransferConfig
    from kv_transfer.source import TransferredCrossKV

    layers, heads, head_dim = SHAPES[shape]
    device = torch.device(args.receiver_device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    blocks_per_window = -(-FRAMES // BLOCK_SIZE)
    pool = BlockPool(IN_FLIGHT * blocks_per_window * 2, BLOCK_SIZE)
    storage = PagedKVStorage(pool.num_blocks, layers, BLOCK_SIZE, heads, head_dim, dtype, device)
    receiver = make_receiver(TransferConfig(connector="nixl"), storage=storage)
    loader = CrossKVLoader(storage, project_states=None, device=device)

    context = multiprocessing.get_context("spawn")
    handles = context.Queue()
    sender = context.Process(
        target=_sender, args=(tree, args.sender_device, shape, pulls, args.staged_poll_ms, handles)
    )
    sender.start()

    loop = StandInLoop(device)
    loop.measure(1.0)  # warm-up
    alone_s = loop.measure(2.0)

    def pull_all(count: int) -> float:
        """Pull ``count`` windows, IN_FLIGHT at a time at most; the seconds it took."""
        started = time.perf_counter()
        loading, done, exhausted = 0, 0, False
        while done < count:
            due = count if not args.rate else int((time.perf_counter() - started) * args.rate) + 1
            while not exhausted and loading < IN_FLIGHT and done + loading < min(count, due):
                handle = handles.get()
                if handle is None:
                    exhausted = True
                    break
                blocks = SimpleNamespace(cross_block_ids=pool.allocate(blocks_per_window))
                request = SimpleNamespace(
                    cross_source=TransferredCrossKV(handle, receiver), blocks=blocks, cross_kv_loading=False
                )
                loader.start(request)
                loading += 1
            for load in loader.take_landed(wait_s=0.05 if not args.rate else 0.5 / args.rate):
                if load.error is not None:
                    raise load.error
                pool.free(load.request.blocks.cross_block_ids)
                loading -= 1
                done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    warm_up = min(20, pulls // 5)
    pull_all(warm_up)  # connections, IPC mappings
    loader.recent_load_s.clear()
    loop.start()
    pulling_s = pull_all(pulls - warm_up)
    beside_s = loop.stop()
    loads_ms = sorted(1000 * s for s in loader.recent_load_s)
    sender.join(timeout=60)
    loader.close()
    receiver.close()
    window_mb = layers * 2 * FRAMES * heads * head_dim * storage.cache.element_size() / 2**20
    return {
        "pulls": len(loads_ms),
        "pull_p50_ms": loads_ms[len(loads_ms) // 2],
        "pull_p95_ms": loads_ms[int(len(loads_ms) * 0.95)],
        "pulls_per_s": len(loads_ms) / pulling_s,
        "gb_per_s": len(loads_ms) * window_mb / 1024 / pulling_s,
        "loop_step_alone_ms": 1000 * alone_s,
        "loop_step_pulling_ms": 1000 * beside_s,
        "window_mb": window_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="large-v3-turbo", choices=list(SHAPES))
    parser.add_argument("--sender-device", default="cpu")
    parser.add_argument("--receiver-device", default="cpu")
    parser.add_argument("--pulls", type=int, default=300)
    parser.add_argument("--rate", type=float, default=0.0, help="pulls started a second; 0: as many as fit")
    parser.add_argument("--staged-poll-ms", type=float, help="the sender's transfer.staged_poll_interval_ms")
    parser.add_argument(
        "--trees", default=".", help="comma-separated checkouts to compare (engine/, kv_transfer/)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--run-one", metavar="TREE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        figures = run_one(args.run_one, args)
        print("FIGURES " + json.dumps(figures), flush=True)
        return

    from benchmarks.recording import markdown_table, record

    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    rows = []
    for round_index in range(args.rounds):
        order = trees if round_index % 2 == 0 else trees[::-1]
        for tree in order:
            command = [sys.executable, __file__, "--run-one", tree, "--shape", args.shape]
            command += ["--sender-device", args.sender_device, "--receiver-device", args.receiver_device]
            command += ["--pulls", str(args.pulls), "--rate", str(args.rate)]
            if args.staged_poll_ms is not None:
                command += ["--staged-poll-ms", str(args.staged_poll_ms)]
            output = subprocess.run(command, capture_output=True, text=True, cwd=tree)
            lines = [line for line in output.stdout.splitlines() if line.startswith("FIGURES ")]
            if not lines:
                sys.exit(f"{tree} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
            f = json.loads(lines[-1].removeprefix("FIGURES "))
            name = "this tree" if tree == str(ROOT) else tree
            rows.append(
                [
                    name,
                    round_index + 1,
                    f["pulls"],
                    f["pull_p50_ms"],
                    f["pull_p95_ms"],
                    f["pulls_per_s"],
                    f["gb_per_s"],
                    f["loop_step_alone_ms"],
                    f["loop_step_pulling_ms"],
                    f["loop_step_pulling_ms"] / f["loop_step_alone_ms"],
                ]
            )
            print(rows[-1], flush=True)
    headers = [
        "tree",
        "round",
        "pulls",
        "pull p50 ms",
        "pull p95 ms",
        "pulls/s",
        "GB/s",
        "loop step alone ms",
        "loop step while pulling ms",
        "slowdown",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.record:
        record(
            f"K/V pulls beside a host-bound loop, {args.shape}, "
            f"{args.sender_device} -> {args.receiver_device}"
            + (f", {args.rate:g} pulls started a second" if args.rate else "")
            + (f", sender polling every {args.staged_poll_ms:g} ms" if args.staged_poll_ms else "")
            + " (bench_kv_pull.py)",
            table,
            notes=f"Windows of {f['window_mb']:.1f} MiB, {IN_FLIGHT} loading at most; pull time from "
            "a loader worker's start to landing; the loop's median step alone and while the pulls ran.",
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
