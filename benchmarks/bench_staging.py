"""The host's part of getting an encoder batch's samples to the encoder: a new stacked array per
batch (what the replicas did before engine/encode/staging.py) against the reused buffer, in one
process, side by side. On a GPU each includes its copy to the device (pageable against
page-locked); on a CPU the buffer is the encoder's input itself.

    .venv/bin/python benchmarks/bench_staging.py [--batches 1,8,32] [--repeats 20] [--record]

Windows of 5-30 s, as the speech set's clips are; medians of ``--repeats`` batches, each batch with
fresh arrays (as windows arriving from the ingress are).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.encode.staging import WindowStaging  # noqa: E402
from engine.model.audio import SAMPLE_RATE, pad_or_trim  # noqa: E402


def _windows(count: int, noise: np.random.Generator) -> list[np.ndarray]:
    return [
        noise.standard_normal(SAMPLE_RATE * int(noise.integers(5, 31))).astype(np.float32)
        for _ in range(count)
    ]


def _median_ms(stage, batch: int, repeats: int, device: torch.device) -> float:
    noise = np.random.default_rng(batch)
    times = []
    for _ in range(repeats + 2):  # the first two warm up (allocator, page-locked buffer)
        windows = _windows(batch, noise)
        started = time.perf_counter()
        out = stage(windows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        del out
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for batch in (int(n) for n in args.batches.split(",")):
        staging = WindowStaging(device, batch)

        def stacked(windows: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.stack([pad_or_trim(samples) for samples in windows])).to(device)

        old, new = (_median_ms(stage, batch, args.repeats, device) for stage in (stacked, staging.to_device))
        rows.append([batch, round(old, 2), round(new, 2), f"{old / new:.1f}x"])
    table = markdown_table(
        ["windows a batch", "stacked anew, ms", "through the reused buffer, ms", "stacked / buffer"], rows
    )
    print(table)
    if args.record:
        record(
            f"The encoder's input: a stacked array per batch against the reused buffer ({device.type})",
            table,
            "Host time to have a batch's samples ready for the encoder (on a GPU, copied to it), "
            "medians; engine/encode/staging.py.",
        )


if __name__ == "__main__":
    main()
