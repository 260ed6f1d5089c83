"""Where one decode step's GPU time goes, by kind of kernel, beside the step's bandwidth bound:
the table to read before tuning the decode path (issue 7).

The step runs eagerly (no CUDA graph) under torch's profiler, so every kernel is a row; graph
replay runs the same kernels without the launch gaps. Random weights of a real shape, requests
past their prompts at a fixed position, as bench_gpu.py's decode section.

    python benchmarks/profile_decode_step.py --shape large-v3 --batch 64 --tokenizer <tokenizer.json>

Runs on a CPU too (--device cpu --shape tiny), for trying it; the figures mean something on a GPU.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import engine_at_batch, peak_bandwidth, step_bytes  # noqa: E402
from benchmarks.gpu_models import engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from benchmarks.recording import markdown_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402

# Kernel-name fragments -> the part of the step they belong to; the first match wins.
KINDS = (
    (
        "attention (Triton paged)",
        ("_paged_attention_kernel", "paged_decode_kernel", "_combine_splits_kernel"),
    ),
    ("residual add + layer norm", ("_add_layer_norm_kernel", "layer_norm")),
    ("matrix products", ("gemm", "gemv", "nvjet", "cutlass", "splitK", "sm90_xmma", "addmm", "mm")),
    ("K/V write (index_put)", ("index_elementwise", "index_put", "scatter")),
    ("elementwise (adds, GELU, copies)", ("elementwise", "gelu", "copy", "add")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment.lower() in lowered for fragment in fragments):
            return kind
    return "other"


def main() -> None:
    parser = profile_arguments(__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    args = parser.parse_args()
    dtype = resolved_dtype(args.device, args.dtype)
    hf = random_hf_whisper(args.shape, args.device, dtype)
    config = EngineConfig(
        model=args.shape,
        device=args.device,
        dtype=str(dtype).removeprefix("torch."),
        attention_backend="triton" if args.device.startswith("cuda") else "torch",
        kv_cache_dtype=args.kv_cache_dtype,
        gpu={"cuda_graphs": False, "compile_encoder": False},
    )
    loaded = engine_model(hf, args.tokenizer or resolve_model_folder("base") / "tokenizer.json", config)
    del hf
    engine, requests = engine_at_batch(loaded, args.batch, args.device)
    step = engine.pipeline.step_input(requests)
    activities = [ProfilerActivity.CUDA] if args.device.startswith("cuda") else [ProfilerActivity.CPU]
    for _ in range(3):
        engine.runner.execute(step)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    with profile(activities=activities) as profiler:
        engine.runner.execute(step)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_kernel: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for event in profiler.key_averages():
        micros = event.device_time_total if args.device.startswith("cuda") else event.self_cpu_time_total
        if micros > 0:
            by_kind[kind_of(event.key)][0] += micros
            by_kind[kind_of(event.key)][1] += event.count
            by_kernel[kind_of(event.key)].append((micros, event.count, event.key))
    total = sum(micros for micros, _ in by_kind.values())
    peak, peak_source = peak_bandwidth(args.device)
    bound_ms = step_bytes(loaded, args.batch, 50) / peak * 1000
    rows = [
        [kind, round(micros / 1000, 3), count, f"{micros / total:.0%}"]
        for kind, (micros, count) in sorted(by_kind.items(), key=lambda item: -item[1][0])
    ]
    rows.append(["all kernels", round(total / 1000, 3), sum(count for _, count in by_kind.values()), "100%"])
    print(
        f"{args.shape}, batch {args.batch}, {args.device}, kv cache {args.kv_cache_dtype}: one eager "
        f"decode step; bandwidth bound {bound_ms:.2f} ms ({peak_source} {peak / 1e12:.2f} TB/s)"
    )
    print(markdown_table(["part of the step", "ms", "kernels", "share"], rows))
    for kind in ("matrix products", "other"):  # the parts to look into first
        for micros, count, name in sorted(by_kernel[kind], reverse=True)[:8]:
            print(f"  {kind}: {micros / 1000:7.3f} ms in {count:3d}  {name[:110]}")


if __name__ == "__main__":
    main()
