"""A file's audio -> windows of at most 30 s cut at quiet points, and the windows' decode results
-> one transcript on the file's timeline.

Shared by the offline API and the HTTP ingress so both cut and join audio the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.audio import N_SAMPLES, SAMPLE_RATE
from engine.request import DecodeResult

# A window may end this much before its 30 s limit to end in a pause instead of inside a word.
CUT_SEARCH_S = 5.0
# Loudness is compared over frames this long: about a syllable's gap.
CUT_FRAME_S = 0.1


@dataclass(frozen=True)
class AudioWindow:
    start_sample: int
    samples: np.ndarray  # at most N_SAMPLES

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None
    duration_s: float
    windows: list[DecodeResult]  # one per window, in order
    window_starts_s: list[float]  # where each window starts on the file's timeline


def split_windows(samples: np.ndarray) -> list[AudioWindow]:
    """Windows of at most 30 s covering the audio; each but the last ends at the quietest
    ``CUT_FRAME_S`` of its last ``CUT_SEARCH_S``, so a cut falls between words where it can."""
    windows = []
    start = 0
    frame = int(CUT_FRAME_S * SAMPLE_RATE)
    search = int(CUT_SEARCH_S * SAMPLE_RATE)
    while start < len(samples):
        end = start + N_SAMPLES
        if end < len(samples):
            region = samples[end - search : end].astype(np.float64)
            # Energy of every frame (a running sum), starting at every 10 ms; cut mid-quietest.
            cumulative = np.concatenate([[0.0], np.cumsum(region**2)])
            step = frame // 10
            energy = (cumulative[frame:] - cumulative[:-frame])[::step]
            end = end - search + int(np.argmin(energy)) * step + frame // 2
        windows.append(AudioWindow(start, samples[start:end]))
        start = end
    return windows


def assemble_transcription(samples: np.ndarray, windows: list[AudioWindow], results: list[DecodeResult]) -> Transcription:
    return Transcription(
        text="".join(result.text for result in results).strip(),
        language=results[0].language if results else None,
        duration_s=len(samples) / SAMPLE_RATE,
        windows=results,
        window_starts_s=[window.start_s for window in windows],
    )
