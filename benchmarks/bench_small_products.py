"""The decoder's products at small batches: cuBLAS against engine/kernels/small_products.py's kernel
(``engine.gpu.small_rows_products``), in one run, on random weights of the real shapes.

For each shape and batch, decode ms per step with the switch at 0 (every product through cuBLAS)
and on (the batch's products through the kernel), each the forward replayed from its CUDA graph and
the whole engine step, beside the memory-bandwidth bound as bench_gpu.py computes it. The two
engines alternate per batch on one loaded model.

    python benchmarks/bench_small_products.py --tokenizer tokenizer.json [--shapes large-v3,large-v3-turbo]
        [--batches 1,2,4,8,16] [--record]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import (  # noqa: E402
    engine_at_batch,
    engine_step_seconds,
    peak_bandwidth,
    release_memory,
    step_bytes,
    timed_per_call,
)
from benchmarks.gpu_models import engine_model, random_hf_whisper, resolved_dtype  # noqa: E402
from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

OUTPUT_TOKENS = 100


def step_ms(loaded, batch: int, device: str, seconds: float, small_rows: int) -> tuple[float, float]:
    """(forward replayed from its graph, whole engine step) in ms, products through the kernel at up
    to ``small_rows`` rows."""
    engine, requests = engine_at_batch(loaded, batch, device, small_rows_products=small_rows)
    runner, step = engine.runner, engine.pipeline.step_input(requests)
    forward = timed_per_call(lambda: runner.execute(step), device, seconds)
    return forward * 1000, engine_step_seconds(engine, device) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="large-v3,large-v3-turbo")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a multilingual Whisper tokenizer.json")
    parser.add_argument("--seconds", type=float, default=0.5, help="least time per timed forward")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    device = "cuda"
    peak, peak_source = peak_bandwidth(device)
    tables = []
    for shape in args.shapes.split(","):
        dtype = resolved_dtype(device)
        hf = random_hf_whisper(shape, device, dtype)
        config = EngineConfig(model=shape, device=device, dtype=str(dtype).removeprefix("torch."))
        loaded = engine_model(hf, args.tokenizer, config)
        del hf
        release_memory(device)
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            cublas = step_ms(loaded, batch, device, args.seconds, 0)
            release_memory(device)  # the engine's KV pool, before the next one is built
            kernel = step_ms(loaded, batch, device, args.seconds, batch)
            release_memory(device)
            bound = step_bytes(loaded, batch, OUTPUT_TOKENS // 2) / peak * 1000
            rows.append(
                [batch, *cublas, *kernel, bound, cublas[0] / bound, kernel[0] / bound, cublas[0] / kernel[0]]
            )
            print(
                f"{shape} bs{batch}: forward {cublas[0]:.3f} -> {kernel[0]:.3f} ms, engine step "
                f"{cublas[1]:.3f} -> {kernel[1]:.3f} ms, bound {bound:.3f} ms",
                flush=True,
            )
        tables.append(
            (
                f"{shape}: decode ms per step, products through cuBLAS and through the small-rows kernel",
                markdown_table(
                    [
                        "batch",
                        "cuBLAS: forward (CUDA graph)",
                        "cuBLAS: engine step",
                        "kernel: forward",
                        "kernel: engine step",
                        f"bandwidth bound ({peak_source} {peak / 1e12:.2f} TB/s)",
                        "cuBLAS forward / bound",
                        "kernel forward / bound",
                        "cuBLAS / kernel (forward)",
                    ],
                    rows,
                ),
            )
        )
        del loaded
        release_memory(device)
    body = titled_tables(tables)
    print(body)
    if args.record:
        record(
            "Decode steps at small batches: cuBLAS against the small-rows kernel (bench_small_products.py)",
            body,
        )


if __name__ == "__main__":
    main()
