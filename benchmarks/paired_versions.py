"""This tree's engine against another version of it, in one process, run in turns: beam search
against greedy, as bench_beams.py measures it.

On the lent GPU machines a beam step is bound by the host's Python, and the host's speed differs
between processes by more than most changes do (benchmarks/RESULTS.md, issue 21): two versions
run as processes of their own cannot be told apart. Here both versions' modules are imported into
one process (the other one's from a folder holding its ``engine/`` and ``benchmarks/``), each
builds its own model from the same random weights and its own engines, and the timed runs take
turns (the order flips every round), so both meet the same host.

    git archive <commit> engine benchmarks kv_transfer deployments | tar -x -C /tmp/other
    python benchmarks/paired_versions.py --other /tmp/other --tokenizer <tokenizer.json>
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.decode.heap import freeze_start_up_objects  # noqa: E402

PACKAGES = ("engine", "benchmarks", "kv_transfer", "deployments")


@contextlib.contextmanager
def version_imported_from(folder: Path):
    """Imports of the project's packages come from ``folder`` inside: the last version's modules
    are dropped from sys.modules first (its objects keep their own). What a version imports only
    later, when it first needs it, comes from whichever version was imported last: the engines are
    warmed up inside, so their kernels and graphs are made with their own version's modules."""
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


class Version:
    """One version's greedy and beam engines, warmed up, and its timed runs."""

    def __init__(self, folder: Path, args: argparse.Namespace):
        with version_imported_from(folder):
            import benchmarks.bench_beams as bench
            from benchmarks.gpu_models import engine_model, random_hf_whisper, resolved_dtype
            from engine.config import EngineConfig

            self.bench = bench
            dtype = resolved_dtype(args.device, args.dtype)
            torch.manual_seed(0)  # the same random weights for both versions
            hf = random_hf_whisper(args.shape, args.device, dtype)
            config = EngineConfig(model=args.shape, device=args.device, dtype=str(dtype).split(".")[-1])
            loaded = engine_model(hf, args.tokenizer, config)
            del hf
            self.engines = {
                beam: bench.beam_engine(loaded, args.device, args.windows, beam, args.tokens)
                for beam in (1, args.beam_size)
            }
            for engine, cross_kv, options in self.engines.values():
                bench.run_windows(engine, cross_kv, options, args.windows)
        self.seconds: dict[int, list[float]] = {beam: [] for beam in self.engines}

    def run(self, windows: int) -> None:
        for beam, (engine, cross_kv, options) in self.engines.items():
            self.seconds[beam].append(self.bench.run_windows(engine, cross_kv, options, windows)[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", type=Path, required=True, help="a folder holding the other version")
    parser.add_argument("--shape", default="large-v3-turbo")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a multilingual Whisper tokenizer.json")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    versions = {"this tree": Version(ROOT, args), "other": Version(args.other.resolve(), args)}
    for name, version in versions.items():
        print(f"{name}: {Path(version.bench.__file__).parents[1]}")
    freeze_start_up_objects()  # both versions' start-up objects, as a replica freezes its own
    beam = args.beam_size
    for round_index in range(args.rounds):
        order = list(versions) if round_index % 2 == 0 else list(reversed(versions))
        for name in order:
            versions[name].run(args.windows)
        costs = ", ".join(
            f"{name} {version.seconds[beam][-1] / version.seconds[1][-1]:.2f}"
            for name, version in versions.items()
        )
        print(f"round {round_index}: beam {beam}'s cost in greedy's requests/s: {costs}", flush=True)
    this, other = versions["this tree"], versions["other"]
    faster = sum(mine < theirs for mine, theirs in zip(this.seconds[beam], other.seconds[beam]))
    rows = []
    for name, version in versions.items():
        greedy, beams = (statistics.median(version.seconds[size]) for size in (1, beam))
        rows.append(
            [name, round(args.windows / greedy, 1), round(args.windows / beams, 1), round(beams / greedy, 2)]
        )
    headers = ["version", "greedy req/s", f"beam {beam} req/s", f"greedy / beam {beam}"]
    table = markdown_table(headers, rows)
    print(table)
    print(f"this tree's beam runs faster than the other's in {faster} of {args.rounds} rounds")
    if args.record:
        notes = (
            f"{args.shape}, random weights, {args.windows} windows at once, {args.tokens} tokens each "
            f"(end of text ignored); medians of {args.rounds} rounds in one process, the versions "
            f"taking turns; this tree's beam runs faster in {faster} of {args.rounds} rounds; "
            f"other = {args.other}."
        )
        record(f"Beam search, two versions in one process (paired_versions.py, {args.shape})", table, notes)


if __name__ == "__main__":
    main()
