"""How the KV cache's block size and dtype set the decode step's speed (the measurement behind
engine.block_size's default).

(a) One layer's cross-attention read (large-v3 shape, 1500 keys, batch 64) through the Triton
    kernel, from a one-layer cache and from the real block-major cache of all 32 layers, by block
    size, bf16 and fp8. CUDA only.
(b) The whole decode step (CUDA graph where it applies) by block size and cache dtype, at batch 64
    and 128, random weights of the shape.
(c) The decode kernels on that read (32-layer cache, 128-token blocks): one head per program
    against the grouped-heads kernel, by heads per program, keys per tile, warps and stages, for
    bf16 and fp8 at two batch sizes (the measurement behind triton_paged.GROUPED_DECODE_TILES).
    CUDA only.

    python benchmarks/bench_kv_layout.py [--shape large-v3] [--sections read,step,kernel]
        [--tokenizer tokenizer.json] [--record]

Runs on a CPU too (--device cpu --shape tiny --sections step), for trying it; the figures mean
something on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_gpu  # noqa: E402
from benchmarks.gpu_models import engine_model, random_hf_whisper, resolved_dtype  # noqa: E402
from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from engine.attention.base import PagedAttentionBatch  # noqa: E402
from engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv.storage import PagedKVStorage  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402

HEADS, HEAD_DIM, KEYS, BATCH, LAYERS = 20, 64, 1500, 64, 32  # large-v3's cross-attention


def layer_read_us(
    layers: int,
    block_size: int,
    dtype: torch.dtype,
    batch_size: int = BATCH,
    backends: dict[str, TritonPagedBackend] | None = None,
) -> dict[str, float]:
    """One layer's cross-attention over blocks in random order, microseconds, by backend (default:
    the production one, under "default")."""
    from triton.testing import do_bench

    blocks_per_request = -(-KEYS // block_size)
    num_blocks = batch_size * blocks_per_request
    storage = PagedKVStorage(num_blocks, layers, block_size, HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    for start in range(0, num_blocks, 64):  # random bf16 values cast a few blocks at a time (fp8 too)
        block = storage.cache[start : start + 64]
        block.copy_(torch.randn(block.shape, device="cuda", dtype=torch.bfloat16))
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch_size, blocks_per_request)
    batch = PagedAttentionBatch(
        torch.arange(batch_size + 1, dtype=torch.int32, device="cuda"),
        torch.full((batch_size,), KEYS, dtype=torch.int32, device="cuda"),
        tables,
        False,
        1,
        KEYS,
    )
    layer = storage.layer_cache(layers - 1)
    query = torch.randn(batch_size, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    backends = backends or {"default": TritonPagedBackend()}
    calls = {
        label: (
            lambda backend=backend, layer=layer: backend.paged_attention(
                query, layer[:, 0], layer[:, 1], batch, 0.125
            )
        )
        for label, backend in backends.items()
    }
    for call in calls.values():  # compile every variant before timing any
        call()
    torch.cuda.synchronize()
    # The best of two rounds, each variant once a round: timed once each, the same kernel came out
    # 177 and 388 us in one sweep (H100, bf16, batch 64).
    rounds = [
        {label: do_bench(call, warmup=10, rep=60) * 1e3 for label, call in calls.items()} for _ in range(2)
    ]
    micros = {label: min(timed[label] for timed in rounds) for label in calls}
    del storage, layer
    torch.cuda.empty_cache()
    return micros


def decode_kernel_variants(element_bytes: int) -> dict[str, TritonPagedBackend]:
    """One head per program (its production tiles), then grouped tiles around the production ones."""
    variants = {
        "production default": TritonPagedBackend(),
        "1 head per program (production tiles)": TritonPagedBackend(decode_heads_per_program=1),
    }
    keys = (64, 128) if element_bytes == 1 else (32, 64)
    for heads in (2, 4):
        for keys_per_tile in keys:
            for warps in (2, 4):
                variants[f"{heads} heads, {keys_per_tile} keys, {warps} warps, 3 stages"] = (
                    TritonPagedBackend(
                        decode_heads_per_program=heads,
                        decode_block_n=keys_per_tile,
                        num_warps=warps,
                        num_stages=3,
                    )
                )
    return variants


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="large-v3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", default="read,step")
    parser.add_argument("--block-sizes", default="16,64,128,256")
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a multilingual Whisper tokenizer.json")
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    tables = []

    if "read" in sections:
        rows = []
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            one_layer = layer_read_us(1, 16, dtype)["default"]
            for block_size in block_sizes:
                micros = layer_read_us(LAYERS, block_size, dtype)["default"]
                rows.append(
                    [str(dtype).removeprefix("torch."), block_size, round(micros, 1), round(one_layer, 1)]
                )
                print(rows[-1], flush=True)
        tables.append(
            (
                "(a) one layer's cross-attention read, large-v3 shape, batch 64, Triton",
                markdown_table(
                    [
                        "cache dtype",
                        "block size",
                        "us, 32-layer block-major cache",
                        "us, one-layer cache (16-token blocks)",
                    ],
                    rows,
                ),
            )
        )

    if "step" in sections:
        dtype = resolved_dtype(args.device)
        hf = random_hf_whisper(args.shape, args.device, dtype)
        tokenizer = args.tokenizer or resolve_model_folder("base") / "tokenizer.json"
        cache_dtypes = ["auto", "fp8_e4m3"] if args.device.startswith("cuda") else ["auto"]
        rows = []
        for cache_dtype in cache_dtypes:
            for block_size in block_sizes:
                loaded = engine_model(
                    hf,
                    tokenizer,
                    EngineConfig(
                        model=args.shape,
                        device=args.device,
                        dtype=str(dtype).removeprefix("torch."),
                        kv_cache_dtype=cache_dtype,
                        block_size=block_size,
                    ),
                )
                bench_gpu._TOKENIZER = loaded.tokenizer
                row = [cache_dtype, block_size]
                for batch in (int(b) for b in args.batches.split(",")):
                    engine, requests = bench_gpu.engine_at_batch(loaded, batch, args.device)
                    step = engine.pipeline.step_input(requests)
                    seconds = bench_gpu.timed_per_call(
                        lambda: engine.runner.execute(step), args.device, args.seconds
                    )
                    row.append(round(seconds * 1e3, 2))
                    del engine, requests, step
                    gc.collect()
                print(row, flush=True)
                rows.append(row)
                del loaded
                gc.collect()
                torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        tables.append(
            (
                f"(b) {args.shape} decode step, ms",
                markdown_table(
                    ["cache dtype", "block size", *(f"batch {b}" for b in args.batches.split(","))], rows
                ),
            )
        )

    if "kernel" in sections:
        rows = []
        for dtype, batch_sizes in ((torch.bfloat16, (64, 128)), (torch.float8_e4m3fn, (64, 256))):
            for batch_size in batch_sizes:
                variants = decode_kernel_variants(dtype.itemsize)
                micros = layer_read_us(LAYERS, 128, dtype, batch_size, variants)
                read_bytes = batch_size * KEYS * HEADS * HEAD_DIM * 2 * dtype.itemsize
                for label, us in micros.items():
                    rows.append(
                        [
                            str(dtype).removeprefix("torch."),
                            batch_size,
                            label,
                            round(us, 1),
                            round(read_bytes / us / 1e6, 2),
                        ]
                    )
                    print(rows[-1], flush=True)
        tables.append(
            (
                "(c) decode kernels, one layer's cross-attention read, large-v3 shape, 128-token blocks",
                markdown_table(["cache dtype", "batch", "kernel", "us", "TB/s"], rows),
            )
        )

    body = titled_tables(tables)
    print(body)
    if args.record:
        record(
            "KV block size and dtype vs decode speed (bench_kv_layout.py)",
            body,
            "The cache is block-major: within one layer's view, a block's keys are the piece read "
            "contiguously, so small blocks scatter each layer's reads across the whole pool.",
        )


if __name__ == "__main__":
    main()
