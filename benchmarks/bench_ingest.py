"""Ingest costs, in one run: decoding + resampling + speech detection per hour of audio on one core
(ours: FFmpeg through PyAV and Silero's sequence ONNX export; faster-whisper's decode_audio and its
Silero VAD), then tiny.en end to end on a long file with many pauses (the whole English speech set
with 1-8 s pauses, 6 minutes), windows packed from speech (VAD) vs cut at quiet points, and the
words each gives on the no-speech noise set of tests/support/noise.py.

    .venv/bin/python benchmarks/bench_ingest.py [--repeats 3] [--threads 2] [--record]

On a shared machine other jobs only ever add time: each cost is the fastest of ``--repeats`` runs.
Prints the three tables; --record appends them to the results log (benchmarks/recording.py).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.audio import SAMPLE_RATE, decode_audio  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.transcribe.evaluation import paused_speech_file, word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from engine.transcribe.speech import SpeechOptions, detect_speech, speech_windows  # noqa: E402
from engine.transcribe.windows import split_windows  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402
from tests.support.encoding import UploadFormat, encode  # noqa: E402
from tests.support.noise import noise_set  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
UPLOADS = [
    UploadFormat("webm/opus 48 kHz", "webm", "webm", "libopus", "s16", 48000),
    UploadFormat("mp3 44.1 kHz", "mp3", "mp3", "libmp3lame", "fltp", 44100),
    UploadFormat("wav 16 kHz", "wav", "wav", "pcm_s16le", "s16", 16000),
]


def fastest_s(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def ingest_costs(samples, repeats: int) -> list[list]:
    """Seconds of one core per hour of audio, ours and faster-whisper's, per stage."""
    from faster_whisper.audio import decode_audio as fw_decode_audio
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    per_hour = 3600 / (len(samples) / SAMPLE_RATE)
    rows = []
    for upload in UPLOADS:
        data = encode(samples, upload)
        ours = fastest_s(lambda: decode_audio(data), repeats)
        theirs = fastest_s(lambda: fw_decode_audio(io.BytesIO(data)), repeats)
        rows.append([f"decode + resample, {upload.name}", ours * per_hour, theirs * per_hour, theirs / ours])
    get_speech_timestamps(samples[:SAMPLE_RATE], VadOptions())  # load both models before timing
    detect_speech(samples[:SAMPLE_RATE], SpeechOptions())
    ours = fastest_s(lambda: detect_speech(samples, SpeechOptions()), repeats)
    theirs = fastest_s(lambda: get_speech_timestamps(samples, VadOptions()), repeats)
    rows.append(["speech detection (Silero VAD)", ours * per_hour, theirs * per_hour, theirs / ours])
    return rows


def end_to_end(transcriber: Transcriber, paused, repeats: int) -> list[list]:
    data = encode(paused.samples, UPLOADS[0])
    options = DecodeOptions(timestamps=True)
    duration_s = len(paused.samples) / SAMPLE_RATE
    rows = []
    for name, speech in [("energy cuts (today)", None), ("VAD chunking", SpeechOptions())]:
        samples = decode_audio(data)
        windows = (
            split_windows(samples)
            if speech is None
            else speech_windows(samples, detect_speech(samples, speech))
        )
        decoded_s = sum(len(window.samples) for window in windows) / SAMPLE_RATE
        outputs = []
        wall_s = fastest_s(
            lambda: outputs.append(transcriber.transcribe([data], options, speech=speech)[0]), repeats
        )
        wer = word_error_rate([paused.text], [outputs[-1].text])
        rows.append(
            [
                name,
                len(windows),
                round(decoded_s),
                round(wall_s, 1),
                round(duration_s / wall_s, 1),
                f"{wer:.1%}",
            ]
        )
    return rows


def noise_words(transcriber: Transcriber) -> list[list]:
    clips = [clip for clip in noise_set() if not clip.speech_at_s]
    off = transcriber.transcribe([clip.samples for clip in clips], DecodeOptions())
    on = transcriber.transcribe([clip.samples for clip in clips], DecodeOptions(), speech=SpeechOptions())
    rows = [[clip.name, len(a.text.split()), len(b.text.split())] for clip, a, b in zip(clips, off, on)]
    rows.append(["all", sum(r[1] for r in rows), sum(r[2] for r in rows)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="for the end-to-end part")
    parser.add_argument("--record", action="store_true", help="append the tables to the results log")
    args = parser.parse_args()
    paused = paused_speech_file(SPEECH_DIR)

    # One core for the ingest costs: pinned, one torch and one onnxruntime thread.
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    torch.set_num_threads(1)
    costs = ingest_costs(paused.samples, args.repeats)
    os.sched_setaffinity(0, cores)

    torch.set_num_threads(args.threads)
    transcriber = Transcriber(loaded=load_model(EngineConfig(model="tiny.en")))
    transcriber.transcribe([paused.samples[: 5 * SAMPLE_RATE]], DecodeOptions())  # warm-up
    e2e = end_to_end(transcriber, paused, max(1, args.repeats - 2))
    noise = noise_words(transcriber)

    tables = [
        (
            "Decode + resample + VAD, one core, seconds per hour of audio",
            markdown_table(["stage", "ours s/h", "faster-whisper s/h", "faster-whisper / ours"], costs),
        ),
        (
            f"tiny.en end to end, {len(paused.samples) / SAMPLE_RATE:.0f} s file with 1-8 s pauses "
            f"(webm/opus upload), {args.threads} threads",
            markdown_table(["windows from", "windows", "audio decoded s", "wall s", "RTFx", "WER"], e2e),
        ),
        (
            "Words written on the no-speech noise set (tests/support/noise.py), tiny.en",
            markdown_table(["clip", "VAD off (today)", "VAD on"], noise),
        ),
    ]
    body = titled_tables(tables)
    print(body)
    if args.record:
        record("Ingest: decoding, speech detection, VAD chunking (bench_ingest.py)", body)


if __name__ == "__main__":
    main()
