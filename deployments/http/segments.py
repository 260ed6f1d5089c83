"""A transcript's segments on the file's timeline, the one shape every format with times is made
from: Whisper's timestamp segments offset by their window's start (srt, vtt, verbose_json and
diarized requests ask the decoder for timestamps), or one segment per window otherwise; with word
timestamps, each segment's words.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import SAMPLE_RATE, Transcription, WindowTimeline, compression_ratio
from engine.types import DecodeResult, TimedText


@dataclass(frozen=True)
class Word:
    word: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Segment:
    id: int
    start_s: float
    end_s: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] | None  # with word timestamps: on the file's timeline, inside the segment


def segments_of(transcription: Transcription) -> list[Segment]:
    """The transcript's segments on the file's timeline: Whisper's timestamp segments when the
    windows were decoded with timestamps, else one segment per window."""
    segments: list[Segment] = []
    for window, timeline in zip(transcription.windows, transcription.timelines):
        segments.extend(window_segments(window, timeline, first_id=len(segments)))
    return segments


def window_segments(window: DecodeResult, timeline: WindowTimeline, first_id: int) -> list[Segment]:
    """One window's part of ``segments_of``, its ids counting on from ``first_id`` (the segments of
    the windows before it), so a stream can send each window's segments as the window is decoded."""
    segments: list[Segment] = []
    window_s = timeline.num_samples / SAMPLE_RATE
    pieces = window.segments
    if pieces is None:
        pieces = [TimedText(0.0, window_s, window.text, window.tokens)]
    for piece in pieces:
        if not piece.text.strip():
            continue
        # Clamped to the window's audio (Whisper may time text into the padding after it),
        # then placed on the file's timeline.
        piece_start_s = min(piece.start_s, window_s)
        piece_end_s = min(max(piece.end_s, piece_start_s), window_s)
        start_s, end_s = timeline.file_span_s(piece_start_s, piece_end_s)
        words = None
        if piece.words is not None:
            words = []
            for word in piece.words:
                word_start_s = min(max(word.start_s, piece_start_s), piece_end_s)
                word_end_s = min(max(word.end_s, word_start_s), piece_end_s)
                file_start_s, file_end_s = timeline.file_span_s(word_start_s, word_end_s)
                file_start_s, file_end_s = max(file_start_s, start_s), min(file_end_s, end_s)
                file_end_s = max(file_end_s, file_start_s)
                words.append(Word(word.word, round(file_start_s, 3), round(file_end_s, 3)))
        segments.append(
            Segment(
                id=first_id + len(segments),
                start_s=round(start_s, 3),
                end_s=round(end_s, 3),
                text=piece.text,
                tokens=piece.tokens,
                temperature=window.temperature,
                avg_logprob=window.avg_logprob,
                compression_ratio=compression_ratio(piece.text),
                no_speech_prob=window.no_speech_prob,
                words=words,
            )
        )
    return segments
