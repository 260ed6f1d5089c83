"""Speakers on the transcript: each word to the speaker whose turn overlaps it most, and a
transcript segment cut wherever the speaker changes.

A word no turn overlaps (said in a pause the VAD left out, or timed a little off) goes to the
nearest turn: a word is always somebody's. Times of words, segments and turns must be on one
timeline (the recording's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.diarize.types import SpeakerTurn
from engine.types import TimedText, TimedWord


@dataclass(frozen=True)
class SpeakerSegment:
    """A piece of a transcript segment said by one speaker; ``words`` join to ``text``."""

    speaker: int | None  # None only when the recording has no turns at all
    start_s: float
    end_s: float
    text: str
    words: list[TimedWord]


def speaker_at(start_s: float, end_s: float, turns: Sequence[SpeakerTurn]) -> int | None:
    """The speaker talking most during [start_s, end_s]; the nearest turn's speaker when none
    overlaps it; None when there are no turns."""
    if not turns:
        return None
    overlap_by_speaker: dict[int, float] = {}
    for turn in turns:
        overlap = min(end_s, turn.end_s) - max(start_s, turn.start_s)
        if overlap > 0:
            overlap_by_speaker[turn.speaker] = overlap_by_speaker.get(turn.speaker, 0.0) + overlap
    if overlap_by_speaker:
        return max(overlap_by_speaker, key=lambda speaker: overlap_by_speaker[speaker])
    middle_s = (start_s + end_s) / 2
    nearest = min(turns, key=lambda turn: max(turn.start_s - middle_s, middle_s - turn.end_s))
    return nearest.speaker


def word_speakers(words: Sequence[TimedWord], turns: Sequence[SpeakerTurn]) -> list[int | None]:
    """Each word's speaker."""
    return [speaker_at(word.start_s, word.end_s, turns) for word in words]


def split_by_speaker(segment: TimedText, turns: Sequence[SpeakerTurn]) -> list[SpeakerSegment]:
    """A transcript segment -> one piece per run of words by one speaker, in order. A segment
    without word timings is not split: it goes whole to the speaker of its own span."""
    if not segment.words:
        speaker = speaker_at(segment.start_s, segment.end_s, turns)
        return [SpeakerSegment(speaker, segment.start_s, segment.end_s, segment.text, [])]
    pieces: list[SpeakerSegment] = []
    run: list[TimedWord] = []
    run_speaker: int | None = None
    for word, speaker in zip(segment.words, word_speakers(segment.words, turns)):
        if run and speaker != run_speaker:
            pieces.append(_piece(run_speaker, run))
            run = []
        run.append(word)
        run_speaker = speaker
    pieces.append(_piece(run_speaker, run))
    return pieces


def _piece(speaker: int | None, words: list[TimedWord]) -> SpeakerSegment:
    return SpeakerSegment(speaker, words[0].start_s, words[-1].end_s, "".join(w.word for w in words), words)
