"""The long-form policy, shared by the offline API and the HTTP ingress so both cut, decode and
join a file's audio the same way: a file's audio -> windows of at most 30 s, and the windows'
decode results -> one transcript on the file's timeline.

A ``LongFormCursor`` says which windows to decode next and with what options, and takes each
window's result; its drivers (the synchronous offline loop, the async ingress) only decode what it
hands out. Parallel: every window, cut at quiet points, at once. Sequential: openai-whisper's loop,
each window starting where the previous one's finished text ended.
"""

from __future__ import annotations

import bisect
import dataclasses
from abc import ABC, abstractmethod
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


# A segment or word crossing a join between two packed pieces by less than this is moved off it.
JOIN_SNAP_S = 0.5


@dataclass(frozen=True)
class WindowTimeline:
    """Where a window's audio lies in the file: the window is pieces of the file played one after
    another (one piece, unless speech detection packed it), each starting at (sample in the
    window, sample in the file)."""

    piece_starts: tuple[tuple[int, int], ...]
    num_samples: int

    def file_s(self, window_s: float, at_end: bool = False) -> float:
        """A time in the window -> the same moment on the file's timeline. A time where two pieces
        join is the end of the first when ``at_end`` (a segment's end), else the next one's start."""
        position = window_s * SAMPLE_RATE
        starts = [window_sample for window_sample, _ in self.piece_starts]
        index = (bisect.bisect_left if at_end else bisect.bisect_right)(starts, position) - 1
        window_sample, file_sample = self.piece_starts[max(index, 0)]
        return (file_sample + position - window_sample) / SAMPLE_RATE

    def file_span_s(self, start_s: float, end_s: float) -> tuple[float, float]:
        """A stretch of the window (a segment, a word) -> its start and end on the file's timeline.

        Whisper times a segment's start a little before its first word and its end a little after
        its last, so a stretch that crosses a join by less than ``JOIN_SNAP_S`` is taken to belong
        to the piece it mostly lies in: without that, a sentence that starts just after a join
        would be dated to the end of the piece before, seconds earlier in the file."""
        joins_s = [window_sample / SAMPLE_RATE for window_sample, _ in self.piece_starts[1:]]
        for join_s in joins_s:
            if start_s < join_s < end_s and join_s - start_s < JOIN_SNAP_S:
                start_s = join_s
            if start_s < join_s < end_s and end_s - join_s < JOIN_SNAP_S:
                end_s = join_s
        file_start_s = self.file_s(start_s)
        return file_start_s, max(self.file_s(end_s, at_end=True), file_start_s)

    @property
    def start_s(self) -> float:
        return self.file_s(0.0)

    @property
    def end_s(self) -> float:
        return self.file_s(self.num_samples / SAMPLE_RATE, at_end=True)


@dataclass(frozen=True)
class AudioWindow:
    start_sample: int  # in the file
    samples: np.ndarray  # at most N_SAMPLES
    # Speech detection packs pieces of the file into one window: (sample in the window, sample in
    # the file) where each begins. None: the window is the file's samples from start_sample on.
    piece_starts: tuple[tuple[int, int], ...] | None = None

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE

    @property
    def timeline(self) -> WindowTimeline:
        return WindowTimeline(self.piece_starts or ((0, self.start_sample),), len(self.samples))


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None
    duration_s: float
    windows: list[DecodeResult]  # one per window, in order
    timelines: list[WindowTimeline]  # where each window's audio lies in the file

    @property
    def languages(self) -> list[str]:
        """The languages its text is in: each window's with text, once, in the order they come."""
        found = [window.language for window in self.windows if window.text.strip() and window.language]
        return list(dict.fromkeys(found))

    @property
    def window_starts_s(self) -> list[float]:
        """Where each window starts on the file's timeline."""
        return [timeline.start_s for timeline in self.timelines]

    @property
    def window_ends_s(self) -> list[float]:
        """Where each ends: the next one's start, unless speech detection left audio out between."""
        return [timeline.end_s for timeline in self.timelines]


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


def assemble_transcription(
    samples: np.ndarray, windows: list[AudioWindow], results: list[DecodeResult]
) -> Transcription:
    return Transcription(
        text="".join(result.text for result in results).strip(),
        language=results[0].language if results else None,
        duration_s=len(samples) / SAMPLE_RATE,
        windows=results,
        timelines=[window.timeline for window in windows],
    )


@dataclass(frozen=True)
class PendingWindow:
    """A window a cursor hands out to be decoded, with the options to decode it with."""

    index: int  # its place among the file's windows
    window: AudioWindow
    options: DecodeOptions


class LongFormCursor(ABC):
    """One file's long-form loop. Its driver decodes the windows ``next_windows`` hands out, batched
    or scheduled however it likes, and gives each result to ``accept`` in window order; when
    ``next_windows`` hands out nothing and no window is being decoded, the transcript is done."""

    @abstractmethod
    def next_windows(self) -> list[PendingWindow]:
        """The windows that can be decoded now and were not handed out before; none while the next
        window depends on a result not yet accepted, or once the file is covered."""

    @abstractmethod
    def accept(self, window: AudioWindow, result: DecodeResult) -> DecodeResult:
        """Record a window's result; returns the result as it enters the transcript."""

    @abstractmethod
    def window_timeline(self, index: int) -> WindowTimeline:
        """Where the audio of accepted window ``index`` lies in the file (as ``accept`` recorded
        it): a window's place without assembling the whole transcript."""

    @abstractmethod
    def transcription(self) -> Transcription:
        """The transcript of the windows accepted so far."""


class ParallelCursor(LongFormCursor):
    """Every window handed out at once with the same options: the audio cut at quiet points
    (``split_windows``), or the windows given (those speech detection packed, which may leave
    audio out)."""

    def __init__(self, samples: np.ndarray, options: DecodeOptions, windows: list[AudioWindow] | None = None):
        self.samples = samples
        self.options = options
        self.windows = split_windows(samples) if windows is None else windows
        self.results: list[DecodeResult] = []
        self._handed_out = False

    def next_windows(self) -> list[PendingWindow]:
        if self._handed_out:
            return []
        self._handed_out = True
        return [PendingWindow(index, window, self.options) for index, window in enumerate(self.windows)]

    def accept(self, window: AudioWindow, result: DecodeResult) -> DecodeResult:
        if window is not self.windows[len(self.results)]:
            raise ValueError("a parallel cursor takes its windows' results in window order")
        self.results.append(result)
        return result

    def window_timeline(self, index: int) -> WindowTimeline:
        if index >= len(self.results):
            raise IndexError(f"window {index} has no result accepted yet")
        return self.windows[index].timeline

    def transcription(self) -> Transcription:
        return assemble_transcription(self.samples, self.windows[: len(self.results)], self.results)


# openai-whisper stops conditioning on previous text after a window this hot: it was unsure, and
# feeding unsure text forward makes the next window repeat it.
PROMPT_RESET_TEMPERATURE = 0.5
MAX_PREVIOUS_TOKENS = 448


class SequentialCursor(LongFormCursor):
    """openai-whisper's sequential long-form loop over one file: one window at a time, decoded with
    the options ``next_window`` gives (the previous text as prompt, timestamps on), its result handed
    to ``accept`` before the next window is known.

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
        self._awaiting_result = False  # the current window was handed out by next_windows

    def next_windows(self) -> list[PendingWindow]:
        step = None if self._awaiting_result else self.next_window()
        if step is None:
            return []
        self._awaiting_result = True
        return [PendingWindow(len(self.results), *step)]

    def next_window(self) -> tuple[AudioWindow, DecodeOptions] | None:
        if self.seek_sample >= len(self.samples):
            return None
        window = AudioWindow(self.seek_sample, self.samples[self.seek_sample : self.seek_sample + N_SAMPLES])
        prompt = tuple(self._previous_tokens) if self.results else self.options.prompt
        return window, dataclasses.replace(self.options, prompt=prompt or None)

    def accept(self, window: AudioWindow, result: DecodeResult) -> DecodeResult:
        """Record the window's result, cut to its finished segments; returns that cut result."""
        self._awaiting_result = False
        segments = result.segments or []
        advance_s = len(window.samples) / SAMPLE_RATE
        tail = segments[-1] if segments else None
        if tail is not None and not tail.closed and len(segments) > 1 and 0 < tail.start_s < advance_s:
            kept = segments[:-1]
            advance_s = tail.start_s
            result = dataclasses.replace(
                result,
                tokens=result.tokens[: -(len(tail.tokens) + 1)],
                text="".join(s.text for s in kept),
                segments=kept,
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

    def window_timeline(self, index: int) -> WindowTimeline:
        return self.windows[index].timeline

    def transcription(self) -> Transcription:
        return assemble_transcription(self.samples, self.windows, self.results)


def long_form_cursor(
    samples: np.ndarray,
    options: DecodeOptions,
    mode: LongFormMode,
    windows: list[AudioWindow] | None = None,
) -> LongFormCursor:
    """The cursor for ``mode``; ``windows`` (parallel only) replaces cutting at quiet points."""
    if mode == "sequential":
        if windows is not None:
            raise ValueError("sequential long-form seeks through the whole file; it takes no windows")
        return SequentialCursor(samples, options)
    return ParallelCursor(samples, options, windows)
