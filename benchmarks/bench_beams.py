"""Beam search's cost, in one run: requests/s at beam 5 against greedy for our engine, and against
transformers' generate(num_beams=5) at the same batch, on random weights of the real shapes, every
window decoding a fixed number of tokens (end of text ignored, so both sides do the same work).

Each row decodes ``--windows`` windows submitted at once (their cross-attention K/V already in
hand: the encoder is the same for greedy and beams). Ours runs them with continuous batching
(room for every window's beams); transformers runs them as one static batch from encoder states
(its beam search keeps a copy of the cross-attention K/V per beam, so large batches do not fit).

    python benchmarks/bench_beams.py [--shapes large-v3,large-v3-turbo] [--windows 16,64]
        [--beam-size 5] [--tokens 100] [--hf-windows 16] [--device cuda] [--pin-cpu 2] [--record]

A beam step's wall time depends on the host's work, and on a shared GPU machine it varies between
runs unless the process stays on one core (``--pin-cpu``).

Prints a row per shape and window count (greedy and beam requests/s, their ratio, and
transformers' beam requests/s where it ran); --record appends the table to the results log
(benchmarks/recording.py).

On a CPU, ``--shapes tiny --device cpu --windows 4 --hf-windows 4 --tokens 16`` tries it out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import (  # noqa: E402
    add_dtype_argument,
    config_for,
    hf_prompt_ids,
    release_memory,
    resolved_dtype,
    sync,
)
from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.engine import DecoderEngine  # noqa: E402
from engine.decode.heap import freeze_start_up_objects  # noqa: E402
from engine.kv.sources import CrossKVTensor  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402
from tests.support.gpu_models import engine_model, random_hf_whisper  # noqa: E402


def beam_engine(
    loaded, device: str, windows: int, beam_size: int, tokens: int
) -> tuple[DecoderEngine, torch.Tensor, DecodeOptions]:
    """An engine with room for ``windows`` windows' hypotheses and their blocks at once; random
    cross-attention K/V for every window; options that decode ``tokens`` tokens at ``beam_size``."""
    dims = loaded.weights.dims
    engine = DecoderEngine(loaded, config_for(loaded, windows * beam_size, beam_size=beam_size))
    cross_kv = torch.randn(
        dims.decoder_layers, 2, dims.n_audio_ctx, dims.decoder_heads, dims.head_dim, device=device
    ).to(loaded.config.torch_dtype)
    options = DecodeOptions(language="en", max_tokens=tokens, ignore_eot=True, beam_size=beam_size)
    return engine, cross_kv, options


def run_windows(
    engine: DecoderEngine, cross_kv: torch.Tensor, options: DecodeOptions, windows: int
) -> tuple[float, int]:
    """Submit ``windows`` windows and step until all are done: (seconds, steps)."""
    device = str(cross_kv.device)
    for _ in range(windows):
        engine.submit(engine.make_request(options, CrossKVTensor(cross_kv)))
    sync(device)
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    sync(device)
    return time.perf_counter() - start, steps


def ours_req_per_s(loaded, device: str, windows: int, beam_size: int, tokens: int, repeats: int) -> float:
    """Windows/s for ``windows`` windows submitted at once, each decoding ``tokens`` tokens: the
    median of ``repeats`` runs after one warm-up run of the same size (a smaller warm-up leaves the
    first timed run to meet the step's batch shapes, and their kernels' first launches, itself)."""
    engine, cross_kv, options = beam_engine(loaded, device, windows, beam_size, tokens)
    run_windows(engine, cross_kv, options, windows)
    freeze_start_up_objects()  # as a decoder replica does once started (release_memory undoes it)
    seconds = [run_windows(engine, cross_kv, options, windows)[0] for _ in range(repeats)]
    return windows / statistics.median(seconds)


@torch.inference_mode()
def hf_req_per_s(
    hf, tokenizer, device: str, windows: int, beam_size: int, tokens: int, repeats: int
) -> float:
    from transformers.generation import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    dims = hf.config
    states = torch.randn(windows, 1500, dims.d_model, device=device, dtype=hf.dtype)

    def run() -> float:
        sync(device)
        start = time.perf_counter()
        GenerationMixin.generate(
            hf,
            encoder_outputs=BaseModelOutput(last_hidden_state=states),
            decoder_input_ids=hf_prompt_ids(windows, device, tokenizer),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            num_beams=beam_size,
            eos_token_id=tokenizer.special.eot,
            pad_token_id=tokenizer.special.eot,
        )
        sync(device)
        return time.perf_counter() - start

    run()  # warm-up
    return windows / statistics.median(run() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="large-v3,large-v3-turbo")
    parser.add_argument("--windows", default="16,64", help="windows decoded at once, one row each")
    parser.add_argument("--hf-windows", type=int, default=16, help="the batch transformers runs at")
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=100, help="tokens every window decodes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is shown)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a multilingual Whisper tokenizer.json")
    add_dtype_argument(parser)
    parser.add_argument(
        "--pin-cpu",
        type=int,
        default=None,
        help="run on this one CPU core (the host's step time then stops jumping between runs)",
    )
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})
    tokenizer_file = args.tokenizer or resolve_model_folder("base") / "tokenizer.json"
    beams, rows, tokenizers = args.beam_size, [], {}
    dtype = resolved_dtype(args.device, args.dtype)
    shapes, window_counts = args.shapes.split(","), [int(count) for count in args.windows.split(",")]
    for shape in shapes:
        hf = random_hf_whisper(shape, args.device, dtype)
        loaded = engine_model(
            hf, tokenizer_file, EngineConfig(model=shape, device=args.device, dtype=str(dtype).split(".")[-1])
        )
        del hf
        tokenizers[shape] = loaded.tokenizer
        for windows in window_counts:
            greedy = ours_req_per_s(loaded, args.device, windows, 1, args.tokens, args.repeats)
            release_memory(args.device)  # the last engine's KV pool
            beam = ours_req_per_s(loaded, args.device, windows, beams, args.tokens, args.repeats)
            release_memory(args.device)
            rows.append([shape, windows, round(greedy, 2), round(beam, 2), round(greedy / beam, 2), "-", "-"])
            print(rows[-1], flush=True)
        del loaded
        release_memory(args.device)
    # transformers after all of ours: run before ours in the same process, its generate() leaves our
    # beam runs slower, which no server of ours meets.
    for shape in shapes if args.hf_windows in window_counts else []:
        hf = random_hf_whisper(shape, args.device, dtype)
        theirs = hf_req_per_s(
            hf, tokenizers[shape], args.device, args.hf_windows, beams, args.tokens, args.repeats
        )
        for row in rows:
            if row[0] == shape and row[1] == args.hf_windows:
                row[5], row[6] = round(theirs, 2), round(row[3] / theirs, 2)
                print(row, flush=True)
        del hf
        release_memory(args.device)
    headers = [
        "shape",
        "windows at once",
        "ours greedy req/s",
        f"ours beam {beams} req/s",
        f"greedy / beam {beams}",
        f"transformers beam {beams} req/s",
        f"ours / transformers, beam {beams}",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.record:
        notes = (
            f"Random weights of each shape, dtype {args.dtype}; every window decodes "
            f"{args.tokens} tokens (end of text ignored); transformers from encoder states, one static "
            f"batch; each figure the median of {args.repeats} timed runs after a warm-up run of that size"
            + (f"; the process pinned to CPU core {args.pin_cpu}." if args.pin_cpu is not None else ".")
        )
        record(f"Beam search: beam {beams} against greedy and transformers (bench_beams.py)", table, notes)


if __name__ == "__main__":
    main()
