"""The host's (Python's) time per beam step, per hypothesis: what a search costs the decode loop
beside the device's work. While a search runs, each step is read back before the next is
launched, so on a GPU this time adds to every step rather than hiding behind the device.

On a CPU everything runs on the host, so the device's part is timed and taken away: the decoder
forward, the KV block copies and writes, the logit rules, log-softmax, sampling and the
candidates' top-k (each of which, on a GPU, is a kernel or a few). What remains is the loop's own
work: scheduling, block tables, step inputs, reading back, the searches' choices and bookkeeping.
The step's [rows, vocab] tensors are freed inside the next forward's timing: on a CPU freeing
them hands tens of MB back to the OS (milliseconds), where a GPU's caching allocator keeps them.

    python benchmarks/profile_beam_host.py --device cpu --shape tiny --batch 64 --tokens 48
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_beams import beam_engine  # noqa: E402
from benchmarks.gpu_models import engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.step import sampling  # noqa: E402
from engine.kv.sources import CrossKVTensor  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402


class DeviceClock:
    """Seconds spent inside wrapped device-side calls; a call inside another counts once."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0
        self._kept: list[torch.Tensor] = []  # the step's large results, freed at the next step's start
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, keep_result: bool = False, frees_kept: bool = False) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                if frees_kept:
                    self._kept.clear()
                result = inner(*args, **kwargs)
                if keep_result:
                    self._kept.append(result)
                return result
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        self._wrapped.append((owner, name, inner))
        setattr(owner, name, timed)

    def unwrap(self) -> None:
        for owner, name, inner in reversed(self._wrapped):
            setattr(owner, name, inner)
        self._wrapped.clear()
        self._kept.clear()


def host_per_step(loaded, windows: int, beam_size: int, tokens: int) -> tuple[float, float, float]:
    """(wall ms per step, host ms per step, host µs per hypothesis-step) for ``windows`` windows."""
    engine, cross_kv, options = beam_engine(loaded, "cpu", windows, beam_size, tokens)
    clock = DeviceClock()
    clock.wrap(engine.runner, "forward", keep_result=True, frees_kept=True)
    clock.wrap(engine.runner, "project_cross_kv")
    for name in ("copy_blocks", "write_sequence", "write_blocks"):
        clock.wrap(engine.storage, name)
    for name in ("apply", "record"):
        clock.wrap(engine.rules, name)
    for name in ("sample", "_candidates"):
        clock.wrap(sampling, name)
    clock.wrap(torch, "log_softmax", keep_result=True)
    clock.wrap(engine.pipeline, "_read_sot_logits")
    rows = 0
    launch = engine.pipeline.launch

    def counting_launch(batch):
        nonlocal rows
        launched = launch(batch)
        rows += len(launched.batch) if launched is not None else 0
        return launched

    engine.pipeline.launch = counting_launch
    for attempt in ("warm-up", "timed"):
        clock.seconds, rows, steps = 0.0, 0, 0
        for _ in range(windows if attempt == "timed" else min(windows, 2)):
            engine.submit(engine.make_request(options, CrossKVTensor(cross_kv)))
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    clock.unwrap()
    host = wall - clock.seconds
    return 1000 * wall / steps, 1000 * host / steps, 1e6 * host / rows


def main() -> None:
    parser = profile_arguments(__doc__.splitlines()[0])
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    if args.device != "cpu":
        raise SystemExit("this takes the device's time away by timing it on the host: --device cpu")
    tokenizer_file = args.tokenizer or resolve_model_folder("base") / "tokenizer.json"
    dtype = resolved_dtype(args.device, args.dtype)
    loaded = engine_model(
        random_hf_whisper(args.shape, args.device, dtype),
        tokenizer_file,
        EngineConfig(model=args.shape, device=args.device, dtype=str(dtype).split(".")[-1]),
    )
    print("| beams | windows | wall ms/step | host ms/step | host µs per hypothesis-step |")
    print("|---|---|---|---|---|")
    for beam_size in (1, args.beam_size):
        wall_ms, host_ms, host_us = host_per_step(loaded, args.batch, beam_size, args.tokens)
        print(f"| {beam_size} | {args.batch} | {wall_ms:.1f} | {host_ms:.2f} | {host_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
