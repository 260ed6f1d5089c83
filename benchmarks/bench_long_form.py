"""Long-form modes compared on one file over a minute long (speech-set clips with a second of
silence between them, the file tests/engine/transcribe/test_long_form.py builds): parallel
windows (cut at quiet points, all in flight at once) vs openai-whisper's sequential loop (one
window after another, each prompted by the text before it). Both with timestamps, greedy, no
fallback.

The figure to read is the ratio (sequential wall time / parallel wall time); absolute times depend
on the machine. On a shared machine other jobs only ever add time, so each mode's fastest of
several interleaved runs is its least disturbed one: the headline ratio is of those minimums.

    .venv/bin/python benchmarks/bench_long_form.py [--threads 2] [--repeats 7] [--record]
    # on a GPU machine:
    python benchmarks/bench_long_form.py --device cuda --model path/to/tiny.en-hf-folder --no-wer

Prints each run's wall time, then a table per mode (windows, fastest and median wall s, RTFx, WER)
and the ratio; --record appends them to the results log (benchmarks/recording.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.transcribe.evaluation import LONG_FORM_CLIP_IDS, long_form_file, word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each mode, interleaved")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny.en", help="bundled name or model folder")
    parser.add_argument(
        "--no-wer", action="store_true", help="where the test extra (jiwer, the normalizer) is missing"
    )
    parser.add_argument("--record", action="store_true", help="append the table to the results log")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    long_file = long_form_file(SPEECH_DIR)
    transcriber = Transcriber(loaded=load_model(EngineConfig(model=args.model, device=args.device)))
    options = DecodeOptions(timestamps=True)
    transcriber.transcribe([long_file.samples[: 16000 * 5]], options)  # warm-up

    seconds: dict[str, list[float]] = {"parallel": [], "sequential": []}
    outputs = {}
    for _ in range(args.repeats):
        for mode in seconds:  # interleaved, so a busy spell on a shared machine hits both modes
            started = time.perf_counter()
            outputs[mode] = transcriber.transcribe([long_file.samples], options, long_form=mode)[0]
            seconds[mode].append(time.perf_counter() - started)
            print(mode, round(seconds[mode][-1], 2), flush=True)

    fastest = {mode: min(times) for mode, times in seconds.items()}
    median = {mode: statistics.median(times) for mode, times in seconds.items()}
    rows = [
        [
            mode,
            len(outputs[mode].windows),
            round(fastest[mode], 2),
            round(median[mode], 2),
            round(long_file.duration_s / fastest[mode], 1),
            "-" if args.no_wer else f"{word_error_rate([long_file.text], [outputs[mode].text]):.1%}",
        ]
        for mode in seconds
    ]
    table = markdown_table(
        ["mode", "windows", "fastest wall s", "median wall s", "RTFx (fastest)", "WER"], rows
    )
    notes = (
        f"{long_file.duration_s:.0f} s file of {len(LONG_FORM_CLIP_IDS)} speech-set clips, {args.model}, "
        f"{args.device}, {args.threads} threads, {args.repeats} interleaved runs of each mode; greedy with "
        "timestamps, no fallback.\n"
        f"**sequential / parallel wall time: {fastest['sequential'] / fastest['parallel']:.2f}x** "
        f"(fastest runs; {median['sequential'] / median['parallel']:.2f}x of the medians). All runs, s: "
        + "; ".join(f"{mode} {', '.join(f'{t:.1f}' for t in times)}" for mode, times in seconds.items())
    )
    print(table)
    print(notes)
    if args.record:
        record("Long-form: parallel windows vs sequential (bench_long_form.py)", table, notes)


if __name__ == "__main__":
    main()
