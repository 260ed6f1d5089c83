"""The engine alone on the weights the app serves, at the app benchmark's concurrency: the
denominator of issue 20's app/engine ratio (benchmarks/run_app_on_gpu.sh runs it after the app).

    python benchmarks/engine_alone.py --model /tmp/whisper-app/large-v3 --max-num-seqs 64,128

A burst of requests through bench_gpu.py's engine loop (the encoder on its own stream in this
process, every window decoding a fixed number of tokens, 224 as in the app benchmark),
``max_num_seqs`` of them decoding at once, as ``max_num_seqs`` clients keep the app full. Prints
tokens/s per concurrency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_gpu  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.model.loading import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the Hugging Face folder the app serves")
    parser.add_argument("--max-num-seqs", default="64,128")
    parser.add_argument("--batches", type=int, default=4, help="requests sent: this many times max_num_seqs")
    parser.add_argument("--encoder-batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=224, help="tokens every window decodes")
    args = parser.parse_args()
    bench_gpu.OUTPUT_TOKENS = args.tokens  # what bench_gpu's requests decode (its default is shorter)
    loaded = load_model(EngineConfig(model=args.model, device="cuda", dtype="bfloat16"))
    runner = EncoderRunner(loaded)
    print("| max_num_seqs | requests | tokens/s | requests/s | mean decode batch | p50 latency s |")
    print("|---|---|---|---|---|---|")
    for max_num_seqs in (int(n) for n in args.max_num_seqs.split(",")):
        count = args.batches * max_num_seqs
        result = bench_gpu.bench_engine_ours(
            loaded, runner, "cuda", count, 1e6, args.encoder_batch, max_num_seqs=max_num_seqs
        )
        torch.cuda.empty_cache()
        print(
            f"| {max_num_seqs} | {count} | {result['req_per_s'] * args.tokens:,.0f} | "
            f"{result['req_per_s']:.1f} | {result['mean_batch']:.1f} | {result['p50_latency_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
