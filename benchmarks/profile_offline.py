"""Where bench_offline.py's time goes for our engine on a CPU: the same clips and settings (tiny.en,
greedy, 2 threads), one request at a time or N in flight, with the wall time split by part (log-mel,
encoder, cross-K/V projection, decoder steps: layers, vocabulary projection, the rest) and, with
--ops, torch's profiler's heaviest operators. The table to read before tuning the CPU path (issue 27).

    .venv/bin/python benchmarks/profile_offline.py [--in-flight 16] [--cpu-dtype auto] [--ops]

Parts are timed by wrapping the engine's methods (no profiler overhead); --ops runs the clips a
second time under the profiler, whose overhead inflates its figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offline import SPEECH_DIR  # noqa: E402
from benchmarks.recording import markdown_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.engine import DecoderEngine  # noqa: E402
from engine.encode import runner as encode_runner  # noqa: E402
from engine.model.audio import load_audio_file  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.model.whisper import AudioEncoder, TextDecoder  # noqa: E402
from engine.transcribe.evaluation import load_manifest  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402

# (owner, method, part): each call's wall time is added to its part.
PARTS = (
    (encode_runner, "log_mel_spectrogram", "log-mel"),
    (AudioEncoder, "forward", "encoder"),
    (TextDecoder, "project_cross_kv", "cross-K/V projection"),
    (DecoderEngine, "step", "decoder steps"),
    (TextDecoder, "forward", "  decoder layers"),
    (TextDecoder, "logits", "  vocabulary projection"),
)


def timed_parts(seconds: dict[str, float]) -> None:
    for owner, method, part in PARTS:
        inner = getattr(owner, method)

        def timed(*args, _inner=inner, _part=part, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_part] += time.perf_counter() - start

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--cpu-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", action="store_true", help="also list torch's profiler's heaviest operators")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clips = [c for c in load_manifest(SPEECH_DIR) if c.text and c.duration_s <= 30]
    audio = [load_audio_file(c.path) for c in clips]
    loaded = load_model(EngineConfig(max_num_seqs=args.in_flight, cpu_dtype=args.cpu_dtype))
    transcriber = Transcriber(loaded=loaded, encoder_batch_size=min(args.in_flight, 8))
    transcriber.transcribe(audio[:1])  # warm-up

    def run() -> None:
        if args.in_flight == 1:
            for samples in audio:
                transcriber.transcribe([samples])
        else:
            transcriber.transcribe(audio)

    seconds: dict[str, float] = defaultdict(float)
    timed_parts(seconds)
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    seconds["  the rest of the steps (scheduling, sampling, K/V loads)"] = (
        seconds["decoder steps"] - seconds["  decoder layers"] - seconds["  vocabulary projection"]
    )
    seconds["wall"] = wall
    parts = [part for _, _, part in PARTS] + list(seconds)[len(PARTS) :]
    rows = [[part, round(seconds[part], 2), f"{seconds[part] / wall:.0%}"] for part in dict.fromkeys(parts)]
    print(f"{len(clips)} clips, {args.in_flight} in flight, cpu_dtype {loaded.config.cpu_dtype}")
    print(markdown_table(["part", "s", "of wall"], rows))
    if args.ops:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            run()
        print(
            profiler.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45
            )
        )


if __name__ == "__main__":
    main()
