"""A file's audio -> 30 s windows, and the windows' decode results -> one transcript.

Shared by the offline API and the HTTP ingress so both cut and join audio the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.audio import N_SAMPLES, SAMPLE_RATE
from engine.request import DecodeResult


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None
    duration_s: float
    windows: list[DecodeResult]  # one per 30 s window, in order


def split_windows(samples: np.ndarray) -> list[np.ndarray]:
    """Consecutive 30 s windows. (Cutting at quiet points is the long-form work's to add.)"""
    return [samples[start : start + N_SAMPLES] for start in range(0, len(samples), N_SAMPLES)]


def assemble_transcription(samples: np.ndarray, window_results: list[DecodeResult]) -> Transcription:
    return Transcription(
        text="".join(result.text for result in window_results).strip(),
        language=window_results[0].language if window_results else None,
        duration_s=len(samples) / SAMPLE_RATE,
        windows=window_results,
    )
