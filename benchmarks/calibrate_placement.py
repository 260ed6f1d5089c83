"""Calibrate the placement planner: one device's encoder seconds per batch of windows and decode
step seconds by rows, measured with the engine alone, written as the profile that
`python -m deployments.placement` reads.

    python benchmarks/calibrate_placement.py --shape large-v3-turbo --out turbo-h100.json
    python benchmarks/calibrate_placement.py --model tiny.en --device cpu \
        --encoder-batches 1,2 --decoder-rows 1,4 --tokens 12 --out tiny-cpu.json

The weights: random ones of a real shape (--shape, as bench_gpu.py builds them: the large
checkpoints need not be on the machine) or a model the engine loads (--model). Encoder: a batch of
30 s windows through log-mel, the encoder and the cross-K/V projection, all the work a window costs
before decoding (timed as bench_gpu.py times its encoder). Decoder: whole engine steps with that
many rows decoding, sampling and bookkeeping included (bench_gpu.py's engine at a batch). A K/V
pull's cost comes from bench_kv_pull.py (its pull p50), passed as --kv-transfer-ms; it is not
measured here.

Prints each figure as it is measured and writes the profile JSON to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_gpu  # noqa: E402
from deployments.placement.inputs import CalibrationProfile  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.model.audio import N_SAMPLES  # noqa: E402
from engine.model.loading import LoadedModel, load_model  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402
from tests.support.gpu_models import SHAPES, engine_model, random_hf_whisper  # noqa: E402


def loaded_model(args: argparse.Namespace) -> LoadedModel:
    """The engine's model: random weights of ``--shape``, or ``--model`` as the engine loads it."""
    if args.shape is None:
        return load_model(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    dtype = bench_gpu.resolved_dtype(args.device, args.dtype)
    hf = random_hf_whisper(args.shape, args.device, dtype)
    config = EngineConfig(model=args.shape, device=args.device, dtype=str(dtype).removeprefix("torch."))
    loaded = engine_model(hf, args.tokenizer or resolve_model_folder("base") / "tokenizer.json", config)
    del hf
    bench_gpu.release_memory(args.device)
    return loaded


def encoder_batch_seconds(loaded: LoadedModel, device: str, batches: list[int], seconds: float) -> dict:
    runner = EncoderRunner(loaded, graph_batch_size=max(batches))  # CUDA graphs where a replica has them
    windows = (torch.randn(max(batches), N_SAMPLES, device=device) * 0.1).float()
    measured = {}
    for batch in batches:
        audio = windows[:batch]
        measured[batch] = bench_gpu.timed_per_call(
            lambda: runner.cross_kv(runner.encode(audio)), device, seconds
        )
        print(f"encoder batch {batch}: {measured[batch] * 1000:.2f} ms", flush=True)
    return measured


def decoder_step_seconds(loaded: LoadedModel, device: str, rows: list[int]) -> dict:
    measured = {}
    for batch in rows:
        engine, requests = bench_gpu.engine_at_batch(loaded, batch, device)
        measured[batch] = bench_gpu.engine_step_seconds(engine, device)
        print(f"decode step, {batch} rows: {measured[batch] * 1000:.3f} ms", flush=True)
        del engine, requests
        bench_gpu.release_memory(device)  # two engines' KV pools at many rows need not fit together
    return measured


def sizes(text: str) -> list[int]:
    return [int(size) for size in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape")
    weights.add_argument("--model", default="tiny.en", help="a bundled name, folder or cached HF id")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="with --shape: a multilingual Whisper tokenizer.json (default: base's)",
    )
    bench_gpu.add_dtype_argument(parser)
    parser.add_argument("--encoder-batches", default="1,8,16,32,64")
    parser.add_argument("--decoder-rows", default="1,16,32,64,128,256")
    parser.add_argument(
        "--tokens", type=int, default=100, help="tokens each request decodes; steps are timed to near its end"
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="least time per encoder measurement")
    parser.add_argument(
        "--kv-transfer-ms", type=float, default=None, help="a K/V pull's cost (bench_kv_pull.py's p50)"
    )
    parser.add_argument("--out", type=Path, required=True, help="where the profile JSON goes")
    args = parser.parse_args()
    bench_gpu.OUTPUT_TOKENS = args.tokens  # what bench_gpu's requests decode
    loaded = loaded_model(args)
    device = str(loaded.config.torch_device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    dtype = str(loaded.config.torch_dtype).removeprefix("torch.")
    encoder_batch_s = encoder_batch_seconds(loaded, device, sizes(args.encoder_batches), args.seconds)
    bench_gpu.release_memory(device)  # the encoder runner's, before the largest KV pool is built
    decoder_step_s = decoder_step_seconds(loaded, device, sizes(args.decoder_rows))
    profile = CalibrationProfile(
        device=name,
        model=args.shape or args.model,
        note=f"benchmarks/calibrate_placement.py, {dtype}" + (", random weights" if args.shape else ""),
        encoder_batch_s=encoder_batch_s,
        decoder_step_s=decoder_step_s,
        kv_transfer_s_per_window=None if args.kv_transfer_ms is None else args.kv_transfer_ms / 1000,
    )
    args.out.write_text(profile.model_dump_json(indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
