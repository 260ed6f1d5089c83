"""The engine alone on the weights the app serves, at the app benchmark's concurrency: the
denominators of the app/engine ratio (benchmarks/run_app_on_gpu.sh runs it after the app).

    python benchmarks/engine_alone.py --model /tmp/whisper-app/large-v3 --max-num-seqs 64,128

Two ways to keep the engine busy, each window decoding a fixed number of tokens (224, as in the app
benchmark) with the encoder on its own stream in this process:
- burst: ``--batches`` x ``max_num_seqs`` requests at once through bench_gpu.py's engine loop; a queue
  always waits, so the decode batch stays near ``max_num_seqs``: the engine's ceiling.
- closed loop: ``max_num_seqs`` clients, each with one window in the engine at a time, sending the
  next as soon as its last is decoded, as bench_load.py's clients do with the app. A window's
  encoding is part of its client's cycle here too, so the decode batch runs below the ceiling for
  the same reason the app's does (Little's law); what the app adds beyond it is its own cost.
Prints tokens/s, the mean decode batch and the mean step for both; for the closed loop also the
mean encoder batch and a window's time from its client's send to the decoder (the encoder's queue and
forward), to set beside the app's own figures.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_gpu  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.engine import DecoderEngine  # noqa: E402
from engine.decode.heap import freeze_start_up_objects  # noqa: E402
from engine.encode.overlap import OverlappedEncoder  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.kv.sources import EncoderStates  # noqa: E402
from engine.model.audio import N_SAMPLES  # noqa: E402
from engine.model.loading import load_model  # noqa: E402


def closed_loop(
    loaded, runner: EncoderRunner, clients: int, encoder_batch: int, warmup_s: float, seconds: float
) -> dict:
    """``clients`` closed-loop clients against the engine: every window waiting is encoded in the
    next encoder batch (up to ``encoder_batch``), decoded, and its client's next window waits for the
    encoder at once. Tokens/s, decode batch and step over ``seconds`` after ``warmup_s``."""
    device = runner.device
    encoder = OverlappedEncoder(runner, project_cross_kv=False)
    engine = DecoderEngine(loaded, bench_gpu.config_for(loaded, clients))
    window = (torch.randn(encoder_batch, N_SAMPLES, device=device) * 0.1).float()
    encoder.runner.encode(window)  # warm-up, as bench_gpu's engine loop does
    engine.submit(engine.make_request(bench_gpu.fixed_options(), EncoderStates(runner.encode(window[:1])[0])))
    while engine.has_work:
        engine.step()
    freeze_start_up_objects()  # as a decoder replica does once started (release_memory undoes it)
    # When each waiting window's client sent it: its time before the decoder is the encoder's queue
    # and forward, as the app's "encoder queue, forward" figures are.
    waiting_since = collections.deque([time.perf_counter()] * clients)
    in_encoder: list[float] = []
    started = time.perf_counter()
    steady_from, stop_at = started + warmup_s, started + warmup_s + seconds
    tokens, mark, busy_s = 0, None, 0.0
    batches, encoded, before_decoder_s = 0, 0, 0.0
    while (now := time.perf_counter()) < stop_at or mark is None:
        if mark is None and now >= steady_from:
            mark = (now, engine.timings.snapshot())
        if not encoder.busy and waiting_since:
            in_encoder = [waiting_since.popleft() for _ in range(min(len(waiting_since), encoder_batch))]
            encoder.submit(window[: len(in_encoder)])
        states = encoder.take(wait=not engine.has_work) if encoder.busy else None
        if states is not None:
            for index in range(len(in_encoder)):
                engine.submit(engine.make_request(bench_gpu.fixed_options(), EncoderStates(states[index])))
            if mark is not None:
                submitted_at = time.perf_counter()
                batches, encoded = batches + 1, encoded + len(in_encoder)
                before_decoder_s += sum(submitted_at - sent_at for sent_at in in_encoder)
        if engine.has_work:
            began = time.perf_counter()
            results = engine.step()
            if mark is not None:
                busy_s += time.perf_counter() - began
                tokens += sum(len(result.tokens) for result in results)
            waiting_since.extend([time.perf_counter()] * len(results))
    elapsed = time.perf_counter() - mark[0]
    steps = engine.timings.steps - mark[1].steps
    rows = engine.timings.rows - mark[1].rows
    read_wait_s = engine.timings.read_wait_s - mark[1].read_wait_s
    if encoder.busy:
        encoder.take(wait=True)
    encoder.close()
    del engine, encoder
    bench_gpu.release_memory(str(device))
    return dict(
        tokens_per_s=tokens / elapsed,
        mean_batch=rows / max(steps, 1),
        step_ms=1000 * busy_s / max(steps, 1),
        read_wait_ms=1000 * read_wait_s / max(steps, 1),
        encoder_batch=encoded / max(batches, 1),
        before_decoder_ms=1000 * before_decoder_s / max(encoded, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the Hugging Face folder the app serves")
    parser.add_argument("--max-num-seqs", default="64,128")
    parser.add_argument("--batches", type=int, default=4, help="requests sent: this many times max_num_seqs")
    parser.add_argument("--encoder-batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=224, help="tokens every window decodes")
    parser.add_argument(
        "--closed-loop-s", type=float, default=30.0, help="closed-loop run after warm-up (0: none)"
    )
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument(
        "--closed-loop-encoder-batches",
        default="64",
        help="most windows an encoder forward takes in the closed loop, one run each (the app's are small)",
    )
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    parser.add_argument(
        "--fp8-encoder", action="store_true", help="engine.gpu.fp8_encoder, for an app that serves with it"
    )
    args = parser.parse_args()
    bench_gpu.OUTPUT_TOKENS = args.tokens  # what bench_gpu's requests decode (its default is shorter)
    # The app's configs serve in dtype auto (fp16 on a GPU): the engine alone runs as they do.
    config = EngineConfig(
        model=args.model, device=args.device, dtype="auto", gpu={"fp8_encoder": args.fp8_encoder}
    )
    loaded = load_model(config)
    largest_batch = max(args.encoder_batch, *map(int, args.closed_loop_encoder_batches.split(",")))
    runner = EncoderRunner(loaded, graph_batch_size=largest_batch)  # as the app's replicas run it
    print(
        "| burst, max_num_seqs | requests | tokens/s | requests/s | decode batch | step ms | p50 latency s |"
    )
    print("|---|---|---|---|---|---|---|")
    for max_num_seqs in (int(n) for n in args.max_num_seqs.split(",")):
        count = args.batches * max_num_seqs
        result = bench_gpu.bench_engine_ours(
            loaded, runner, args.device, count, 1e6, args.encoder_batch, max_num_seqs=max_num_seqs
        )
        print(
            f"| {max_num_seqs} | {count} | {result['req_per_s'] * args.tokens:,.0f} | "
            f"{result['req_per_s']:.1f} | {result['mean_batch']:.1f} | "
            f"{1000 * result['step_s'] / max(1, result['steps']):.2f} | {result['p50_latency_s']:.2f} |",
            flush=True,
        )
    if args.closed_loop_s <= 0:
        return
    print(
        "\n| closed-loop clients | encoder batch up to | tokens/s | decode batch | step ms | reading back "
        "| encoder batch | a window's encoder queue + forward ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for clients in (int(n) for n in args.max_num_seqs.split(",")):
        for encoder_batch in (int(n) for n in args.closed_loop_encoder_batches.split(",")):
            result = closed_loop(loaded, runner, clients, encoder_batch, args.warmup_s, args.closed_loop_s)
            print(
                f"| {clients} | {encoder_batch} | {result['tokens_per_s']:,.0f} | {result['mean_batch']:.1f} "
                f"| {result['step_ms']:.2f} | {result['read_wait_ms']:.2f} | {result['encoder_batch']:.1f} "
                f"| {result['before_decoder_ms']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
