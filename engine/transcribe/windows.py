"""A file's audio -> windows of at most 30 s cut at quiet points, and the windows' decode results
-> one transcript on the file's timeline; or, in sequential mode, openai-whisper's loop, where each
window starts where the previous one's finished text ended.

Shared by the offline API and the HTTP ingress so both cut and join audio the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from engine.model.audio import N_SAMPLES, SAMPLE_RATE
from engine.types import DecodeOptions, DecodeResult

# parallel: windows cut at quiet points, all decoded at once. sequential: openai-whisper's loop,
# each window conditioned on the text before it and starting where that text's last segment ended.
LongFormMode = Literal["parallel", "sequential"]

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


# openai-whisper stops conditioning on previous text after a window this hot: it was unsure, and
# feeding unsure text forward makes the next window repeat it.
PROMPT_RESET_TEMPERATURE = 0.5
MAX_PREVIOUS_TOKENS = 448


class SequentialCursor:
    """openai-whisper's sequential long-form loop over one file, as a cursor its driver (the
    offline API, the HTTP ingress) advances: ask ``next_window``, decode it with the options it
    gives (the previous text as prompt, timestamps on), hand the result to ``accept``.

    A window's unfinished last segment (text after its last timestamp, when earlier segments
    closed) is dropped and the next window starts where it began, so no word is cut at 30 s.
    """

    def __init__(self, samples: np.ndarray, options: DecodeOptions):
        self.samples = samples
        self.options = dataclasses.replace(options, timestamps=True)
        self.seek_sample = 0
        self.windows: list[AudioWindow] = []
        self.results: list[DecodeResult] = []
        # The previous windows' tokens, timestamps included: conditioned on words alone, Whisper
        # tends to stop emitting timestamps and skip speech (seen with tiny.en). A text prompt
        # from the caller conditions the first window.
        self._previous_tokens: list[int] = []

    def next_window(self) -> tuple[AudioWindow, DecodeOptions] | None:
        if self.seek_sample >= len(self.samples):
            return None
        window = AudioWindow(self.seek_sample, self.samples[self.seek_sample : self.seek_sample + N_SAMPLES])
        prompt = tuple(self._previous_tokens) if self.results else self.options.prompt
        return window, dataclasses.replace(self.options, prompt=prompt or None)

    def accept(self, window: AudioWindow, result: DecodeResult) -> DecodeResult:
        """Record the window's result, cut to its finished segments; returns that cut result."""
        segments = result.segments or []
        advance_s = len(window.samples) / SAMPLE_RATE
        tail = segments[-1] if segments else None
        if tail is not None and not tail.closed and len(segments) > 1 and 0 < tail.start_s < advance_s:
            kept = segments[:-1]
            advance_s = tail.start_s
            result = dataclasses.replace(
                result, tokens=result.tokens[: -(len(tail.tokens) + 1)], text="".join(s.text for s in kept), segments=kept,
            )
        advance = max(1, round(advance_s * SAMPLE_RATE))
        self.windows.append(AudioWindow(window.start_sample, window.samples[:advance]))
        self.results.append(result)
        self.seek_sample += advance
        if result.temperature > PROMPT_RESET_TEMPERATURE:
            self._previous_tokens = []
        else:
            # The decoder keeps at most half its context of previous tokens; this is more than that.
            self._previous_tokens = (self._previous_tokens + result.tokens)[-MAX_PREVIOUS_TOKENS:]
        return result

    def transcription(self) -> Transcription:
        return assemble_transcription(self.samples, self.windows, self.results)
