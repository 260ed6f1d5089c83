"""The Triton paged-attention backend's split settings against a decode step's kernel time: for
each setting, the attention kernels' and all kernels' device time of one eager step, at several
batch sizes, on one engine in one process (the settings are changed between runs).

The split plan (engine/attention/triton_paged.py) decides how many programs read a window's 1500
cross-attention keys; too few leave the memory idle at small batches. Random weights of a real
shape, requests past their prompts, as bench_gpu.py's decode section.

    python benchmarks/sweep_attention_splits.py --shape large-v3 --batches 1,16,64 \
        --tokenizer <tokenizer.json>

Each setting is ``min_keys_per_split/max_splits/target_waves``; the first listed is the baseline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import engine_at_batch  # noqa: E402
from benchmarks.gpu_models import engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from benchmarks.profile_decode_step import kind_of  # noqa: E402
from benchmarks.recording import markdown_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402

SETTINGS = "256/16/2,128/16/2,64/32/2,64/32/4,32/48/4,128/32/4,64/32/8"


def step_kernel_ms(engine, step, repeats: int = 2) -> tuple[float, float]:
    """(attention, all kernels) device ms of one eager forward, the least of ``repeats``."""
    for _ in range(3):  # compiles the kernels this plan launches
        engine.runner.execute(step)
    torch.cuda.synchronize()
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            engine.runner.execute(step)
            torch.cuda.synchronize()
        events = profiler.key_averages()
        attention = sum(e.device_time_total for e in events if kind_of(e.key).startswith("attention"))
        best = min(best, (attention / 1000, sum(e.device_time_total for e in events) / 1000))
    return best


def main() -> None:
    parser = profile_arguments(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--settings", default=SETTINGS, help="min_keys/max_splits/target_waves, ...")
    args = parser.parse_args()
    dtype = resolved_dtype(args.device, args.dtype)
    config = EngineConfig(
        model=args.shape,
        device=args.device,
        dtype=str(dtype).removeprefix("torch."),
        attention_backend="triton",
        gpu={"cuda_graphs": False, "compile_encoder": False},
    )
    hf = random_hf_whisper(args.shape, args.device, dtype)
    loaded = engine_model(hf, args.tokenizer or resolve_model_folder("base") / "tokenizer.json", config)
    del hf
    settings = [tuple(float(part) for part in setting.split("/")) for setting in args.settings.split(",")]
    batches = [int(batch) for batch in args.batches.split(",")]
    cells: dict[tuple, list[str]] = {setting: [] for setting in settings}
    for batch in batches:
        engine, requests = engine_at_batch(loaded, batch, args.device)
        step = engine.pipeline.step_input(requests)
        backend = engine.runner.backend
        for setting in settings:
            backend.min_keys_per_split, backend.max_splits = int(setting[0]), int(setting[1])
            backend.target_waves = setting[2]
            attention, total = step_kernel_ms(engine, step)
            cells[setting].append(f"{attention:.3f} / {total:.3f}")
            print(f"batch {batch} {setting}: attention {attention:.3f} / all {total:.3f} ms", flush=True)
        del engine, requests
        torch.cuda.empty_cache()
    headers = ["min_keys_per_split / max_splits / target_waves"] + [
        f"batch {batch}: attention / all kernels ms" for batch in batches
    ]
    rows = [[f"{int(s[0])} / {int(s[1])} / {s[2]:g}", *cells[s]] for s in settings]
    print(f"{args.shape}, {args.device}, one eager decode step's kernel time")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
