"""A transcript -> the response body of each OpenAI `response_format`.

Segments come one per 30 s window until the long-form work adds timestamp-token segments; their
times are on the file's timeline either way.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

from engine.audio import CHUNK_LENGTH_S
from engine.transcript import Transcription

ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]
RESPONSE_FORMATS: tuple[str, ...] = ("json", "text", "srt", "vtt", "verbose_json")


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


def compression_ratio(text: str) -> float:
    """openai-whisper's repetition signal: raw bytes / zlib-compressed bytes."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def segments_of(transcription: Transcription) -> list[Segment]:
    segments = []
    for index, window in enumerate(transcription.windows):
        start_s = index * CHUNK_LENGTH_S
        end_s = min(start_s + CHUNK_LENGTH_S, transcription.duration_s)
        if not window.text.strip():
            continue
        segments.append(
            Segment(
                id=len(segments), start_s=start_s, end_s=end_s, text=window.text, tokens=window.tokens,
                temperature=window.temperature, avg_logprob=window.avg_logprob,
                compression_ratio=compression_ratio(window.text), no_speech_prob=window.no_speech_prob,
            )
        )
    return segments


def _clock(seconds: float, decimal_marker: str) -> str:
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def to_srt(segments: list[Segment]) -> str:
    blocks = [
        f"{number}\n{_clock(s.start_s, ',')} --> {_clock(s.end_s, ',')}\n{s.text.strip()}\n"
        for number, s in enumerate(segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(segments: list[Segment]) -> str:
    cues = [f"{_clock(s.start_s, '.')} --> {_clock(s.end_s, '.')}\n{s.text.strip()}\n" for s in segments]
    return "WEBVTT\n\n" + "\n".join(cues)


def to_verbose_json(transcription: Transcription, task: str) -> dict:
    return {
        "task": task,
        "language": transcription.language or "",
        "duration": round(transcription.duration_s, 3),
        "text": transcription.text,
        "segments": [
            {
                "id": s.id, "seek": round(s.start_s * 100), "start": s.start_s, "end": round(s.end_s, 3),
                "text": s.text, "tokens": s.tokens, "temperature": s.temperature,
                "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in segments_of(transcription)
        ],
    }
