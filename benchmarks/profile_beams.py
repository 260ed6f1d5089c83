"""Where a beam-search step's time goes against a greedy one's, on random weights of a real shape:
wall time per step, GPU kernel time per step (torch's profiler), the kernels that take most of it,
the host functions that take most of the beam run (cProfile), and what the step's device calls
cost the host (launches, graph replays, uploads, downloads: each timed around the call, beside a
plain one-element add as the floor). The step loop is bench_beams.py's: ``--windows`` windows
submitted at once, each decoding ``--tokens`` tokens.

    python benchmarks/profile_beams.py --shape large-v3-turbo --batch 16 --tokenizer <tokenizer.json>

Runs on a CPU too (--device cpu --shape tiny --batch 4 --tokens 16), for trying it.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_beams import beam_engine, run_windows  # noqa: E402
from benchmarks.gpu_models import engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.step import choice_graphs, pipeline, sampling  # noqa: E402
from engine.kv import storage  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402


def profile_one(loaded, device: str, windows: int, beam_size: int, tokens: int, top: int) -> None:
    engine, cross_kv, options = beam_engine(loaded, device, windows, beam_size, tokens)
    run_windows(engine, cross_kv, options, windows)  # warm-up: kernels compiled, choice graphs captured

    seconds, steps = run_windows(engine, cross_kv, options, windows)
    wall_ms = 1000 * seconds / steps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as profiler:
        _, steps = run_windows(engine, cross_kv, options, windows)
    events = [event for event in profiler.key_averages() if event.self_device_time_total > 0]
    kernel_ms = sum(event.self_device_time_total for event in events) / 1000 / steps
    print(
        f"\n## beam {beam_size}, {windows} windows: {wall_ms:.2f} ms/step wall, "
        f"{kernel_ms:.2f} ms/step in kernels"
    )
    for event in sorted(events, key=lambda event: event.self_device_time_total, reverse=True)[:top]:
        print(f"  {event.self_device_time_total / 1000 / steps:8.3f} ms/step  {event.key[:100]}")

    host = cProfile.Profile()
    host.enable()
    run_windows(engine, cross_kv, options, windows)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:])
    if device.startswith("cuda"):
        host_call_costs(engine, cross_kv, options, windows)
    del engine


# The step's device calls worth timing: (owner, attribute, label).
_DEVICE_CALLS = (
    (torch.cuda.CUDAGraph, "replay", "CUDA graph replay (decode step, beam choice)"),
    (choice_graphs, "triton_choose_beams", "beam choice kernel, launched"),
    (storage, "triton_copy_blocks", "block copy kernel, launched"),
    (sampling, "triton_top_candidates", "top-candidates kernel"),
    (sampling, "upload", "upload (sampling)"),
    (pipeline, "PendingDownload", "download (a step's tokens, rankings, candidates)"),
    (torch, "log_softmax", "log-softmax"),
)


def host_call_costs(engine, cross_kv, options, windows: int) -> None:
    """Host µs per call of the step's device calls in one run, and a plain add's."""
    spent: dict[str, list[float]] = {}
    originals = []
    for owner, name, label in _DEVICE_CALLS:
        inner = getattr(owner, name)
        originals.append((owner, name, inner))

        def timed(*args, _inner=inner, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent.setdefault(_label, []).append(time.perf_counter() - start)

        setattr(owner, name, functools.wraps(inner)(timed))
    try:
        _, steps = run_windows(engine, cross_kv, options, windows)
    finally:
        for owner, name, inner in originals:
            setattr(owner, name, inner)
    one = torch.zeros(1, device=cross_kv.device)
    for _ in range(20):
        one.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        one.add_(1)
    floor_us = (time.perf_counter() - start) / 200 * 1e6
    print(f"\nhost time of the step's device calls (a one-element add: {floor_us:.1f} us a call)")
    for label, seconds in spent.items():
        print(
            f"  {len(seconds) / steps:5.2f}/step  {1e6 * sum(seconds) / len(seconds):7.1f} us/call  "
            f"{1e3 * sum(seconds) / steps:6.3f} ms/step  {label}"
        )


def main() -> None:
    parser = profile_arguments(__doc__.splitlines()[0])
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    tokenizer_file = args.tokenizer or resolve_model_folder("base") / "tokenizer.json"
    dtype = resolved_dtype(args.device, args.dtype)
    hf = random_hf_whisper(args.shape, args.device, dtype)
    loaded = engine_model(
        hf,
        tokenizer_file,
        EngineConfig(model=args.shape, device=args.device, dtype=str(dtype).split(".")[-1]),
    )
    del hf
    for beam_size in (1, args.beam_size):
        profile_one(loaded, args.device, args.batch, beam_size, args.tokens, args.top)


if __name__ == "__main__":
    main()
