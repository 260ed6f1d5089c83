"""Where a beam-search step's time goes against a greedy one's, on random weights of a real shape:
wall time per step, GPU kernel time per step (torch's profiler), the kernels that take most of it,
and the host functions that take most of the beam run (cProfile). The step loop is
bench_beams.py's: ``--windows`` windows submitted at once, each decoding ``--tokens`` tokens.

    python benchmarks/profile_beams.py --shape large-v3-turbo --batch 16 --tokenizer <tokenizer.json>

Runs on a CPU too (--device cpu --shape tiny --batch 4 --tokens 16), for trying it.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_beams import beam_engine, run_windows  # noqa: E402
from benchmarks.gpu_models import engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402


def profile_one(loaded, device: str, windows: int, beam_size: int, tokens: int, top: int) -> None:
    engine, cross_kv, options = beam_engine(loaded, device, windows, beam_size, tokens)
    run_windows(engine, cross_kv, options, min(windows, 2))  # warm-up

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
    del engine


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
