"""What decoding an upload out of the ingress's process costs (engine/model/decode_processes.py):
one file decoded in process, through a persistent decoding process (the ingress's pool), and in a
process started for it (an interpreter and its imports each time), for an 11 s clip and an hour
of samples (silence in a WAV that claims 1 Hz, a few KB on the wire).

    .venv/bin/python benchmarks/bench_decode_processes.py [--repeats 5] [--record]

On a shared machine other jobs only ever add time: each cost is the fastest of ``--repeats`` runs.
Prints one table of milliseconds per file; --record appends it to the results log
(benchmarks/recording.py).
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.model.decode_processes import DecodeProcesses  # noqa: E402
from engine.model.ffmpeg import SAMPLE_RATE, decode_audio  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"


def wav_claiming_one_hertz(duration_s: int) -> bytes:
    data = np.zeros(duration_s, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16)
    chunks = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def fastest_ms(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def decoded_in_a_new_process(data: bytes) -> np.ndarray:
    """A process started for this upload alone: what the pool saves."""
    pool = DecodeProcesses(1)
    try:
        return pool.decode(data)
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="append the table to the results log")
    args = parser.parse_args()
    files = [
        ("jfk.flac, 11 s speech", (SPEECH_DIR / "jfk.flac").read_bytes()),
        ("1 h silence (WAV claiming 1 Hz)", wav_claiming_one_hertz(3600)),
    ]
    pool = DecodeProcesses(1)
    rows = []
    try:
        for name, data in files:
            samples = decode_audio(data)
            np.testing.assert_array_equal(pool.decode(data), samples)  # and the pool is warm
            rows.append(
                [
                    name,
                    f"{len(data) / 1024:.0f} KB",
                    round(len(samples) / SAMPLE_RATE),
                    fastest_ms(lambda: decode_audio(data), args.repeats),
                    fastest_ms(lambda: pool.decode(data), args.repeats),
                    fastest_ms(lambda: decoded_in_a_new_process(data), args.repeats),
                ]
            )
    finally:
        pool.close()
    table = markdown_table(
        ["file", "upload", "audio s", "in process ms", "pool ms", "process per request ms"], rows
    )
    print(table)
    if args.record:
        record("Decoding uploads out of the ingress's process (bench_decode_processes.py)", table)


if __name__ == "__main__":
    main()
