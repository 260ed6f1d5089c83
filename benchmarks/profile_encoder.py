"""Where one encoder batch's GPU time goes, by kind of kernel, beside its compute floor: the table
to read before tuning the encoder (issue 7). The encoder runs as the engine runs it (log-mel, then
the encoder compiled with torch.compile), on random weights of a real shape.

    python benchmarks/profile_encoder.py --shape large-v3 --batch 64
        [--compile-mode max-autotune-no-cudagraphs]

Runs on a CPU too (--device cpu --shape tiny), for trying it; the figures mean something on a GPU.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_models import SHAPES, engine_model, profile_arguments, random_hf_whisper, resolved_dtype  # noqa: E402
from benchmarks.recording import markdown_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.model.audio import N_SAMPLES  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402

# Kernel-name fragments -> the part of the encoder they belong to; the first match wins.
KINDS = (
    # cuDNN's convolution kernels and their layout transforms first: their names say cudnn too.
    (
        "convolutions (with their fused bias and GELU)",
        ("implicit_gemm", "nhwc", "nchw", "conv", "winograd", "im2col"),
    ),
    ("attention (SDPA)", ("fmha", "flash", "sdpa", "attention")),
    ("matrix products", ("gemm", "nvjet", "cutlass", "sm90_xmma", "splitk", "addmm", "mm_")),
    ("log-mel (FFT)", ("fft", "stft", "radix")),
    ("fused elementwise (norms, GELU, adds)", ("triton_",)),
    ("other elementwise", ("elementwise", "copy", "reduce", "norm", "gelu")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def encoder_flops(shape: str) -> float:
    """Multiply-adds x 2 of one 30 s window: the two convolutions, every layer's projections and
    MLP, and attention's two products over 1500 frames."""
    dims = SHAPES[shape]
    d, ffn, layers, frames = dims["d_model"], dims["encoder_ffn_dim"], dims["encoder_layers"], 1500
    convs = 2 * frames * dims["num_mel_bins"] * 3 * d + frames * d * 3 * d
    per_layer = frames * (4 * d * d + 2 * d * ffn) + 2 * frames * frames * d
    return 2.0 * (convs + layers * per_layer)


def main() -> None:
    parser = profile_arguments(__doc__.splitlines()[0])
    parser.add_argument(
        "--compile-mode", default=None, help="torch.compile mode for the encoder (default: torch's)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=798.0,
        help="the device's bf16 matrix-product rate (798 measured on the lent H100)",
    )
    parser.add_argument("--fp8-encoder", action="store_true", help="engine.gpu.fp8_encoder")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = resolved_dtype(args.device, args.dtype)
    hf = random_hf_whisper(args.shape, args.device, dtype)
    config = EngineConfig(
        model=args.shape,
        device=args.device,
        dtype=str(dtype).removeprefix("torch."),
        gpu={"compile_encoder": False, "fp8_encoder": args.fp8_encoder},
    )
    loaded = engine_model(hf, args.tokenizer or resolve_model_folder("base") / "tokenizer.json", config)
    del hf
    if cuda:
        loaded.model.encoder.compile(mode=args.compile_mode)
    runner = EncoderRunner(loaded)
    windows = (torch.randn(args.batch, N_SAMPLES, device=args.device) * 0.1).float()
    started = time.perf_counter()
    for _ in range(3):
        runner.encode(windows)
    if cuda:
        torch.cuda.synchronize()
    print(f"compile and warm-up: {time.perf_counter() - started:.1f} s", flush=True)
    repeats = 5
    started = time.perf_counter()
    for _ in range(repeats):
        runner.encode(windows)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        runner.encode(windows)
        if cuda:
            torch.cuda.synchronize()

    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for event in profiler.key_averages():
        micros = event.device_time_total if cuda else event.self_cpu_time_total
        if micros > 0:
            kind = kind_of(event.key)
            by_kind[kind][0] += micros
            by_kind[kind][1] += event.count
            names[kind].append((micros, event.key))
    total = sum(micros for micros, _ in by_kind.values())
    floor_ms = encoder_flops(args.shape) * args.batch / (args.peak_tflops * 1e12) * 1000
    rows = [
        [kind, round(micros / 1000, 2), count, f"{micros / total:.0%}"]
        for kind, (micros, count) in sorted(by_kind.items(), key=lambda item: -item[1][0])
    ]
    rows.append(["all kernels", round(total / 1000, 2), sum(count for _, count in by_kind.values()), "100%"])
    print(
        f"{args.shape}, batch {args.batch}, {args.device}, compile mode {args.compile_mode}: "
        f"{args.batch / seconds:.1f} windows/s ({seconds * 1000:.1f} ms a batch); compute floor "
        f"{floor_ms:.1f} ms at {args.peak_tflops:g} TFLOP/s"
    )
    print(markdown_table(["part of the encoder", "ms", "kernels", "share"], rows))
    for kind, entries in names.items():
        for micros, name in sorted(entries, reverse=True)[:4]:
            print(f"  {kind}: {micros / 1000:8.2f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
