"""A transcript -> the response of each OpenAI `response_format`.

Segment times are on the file's timeline: Whisper's timestamp tokens offset by the window's start
(srt, vtt and verbose_json ask the decoder for timestamps), or whole windows otherwise. json and
verbose_json carry the ``usage`` OpenAI's API reports for models billed by audio duration; json
carries OpenAI's ``languages``, verbose_json its ``language``. diarized_json is OpenAI's format
with speakers: segments cut where the speaker changes, each with its speaker's label
(deployments/http/speakers.py); verbose_json asked for with diarize=true carries a ``speaker`` on each
segment and word.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from deployments.http.segments import Segment, segments_of
from deployments.http.speakers import Speakers, SpokenSegment
from engine import Transcription
from engine.types import DecodeResult, TokenLogprob

RESPONSE_FORMATS: tuple[str, ...] = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")


def duration_usage(duration_s: float) -> dict:
    """OpenAI's usage object for models billed by the second: the seconds of audio the request sent
    (all of it, with or without speech), as a number."""
    return {"type": "duration", "seconds": round(duration_s, 3)}


def languages_of(transcription: Transcription) -> list[dict]:
    """OpenAI's ``languages``: those the text is in, each as ``{"code": ...}``; empty when there is
    no text to have a language."""
    return [{"code": code} for code in transcription.languages]


def logprobs_of(token_logprobs: list[TokenLogprob]) -> list[dict]:
    """OpenAI's ``logprobs`` (of a transcription, or of a realtime turn's completed event): per
    text token, its text, its log-probability and its UTF-8 bytes."""
    return [
        {"token": item.token, "logprob": item.logprob, "bytes": list(item.token.encode())}
        for item in token_logprobs
    ]


def logprobs_of_windows(windows: list[DecodeResult]) -> list[dict]:
    """``logprobs_of`` the windows' text tokens, in window order."""
    return logprobs_of([item for window in windows for item in window.token_logprobs or []])


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


def diarized_segment(segment: SpokenSegment) -> dict:
    """OpenAI's diarized segment, in diarized_json's ``segments`` and as a stream's event."""
    return {
        "type": "transcript.text.segment",
        "id": f"seg_{segment.id}",
        "start": segment.start_s,
        "end": segment.end_s,
        "text": segment.text,
        "speaker": segment.speaker,
    }


def to_diarized_json(transcription: Transcription, speakers: Speakers) -> dict:
    return {
        "task": "transcribe",
        "duration": round(transcription.duration_s, 3),
        "text": transcription.text,
        "segments": [diarized_segment(s) for s in speakers.spoken_segments(segments_of(transcription))],
        "usage": duration_usage(transcription.duration_s),
    }


def to_verbose_json(
    transcription: Transcription,
    task: str,
    with_words: bool = False,
    with_segments: bool = True,
    speakers: Speakers | None = None,
) -> dict:
    """OpenAI's verbose_json: ``segments`` unless only word timestamps were asked for, ``words``
    when they were; with ``speakers`` (diarize=true) a ``speaker`` on each of both."""
    segments = segments_of(transcription)
    labels = speakers.segment_speakers(segments) if speakers is not None else None
    body = {
        "task": task,
        "language": transcription.language or "",
        "duration": round(transcription.duration_s, 3),
        "text": transcription.text,
    }
    if with_segments:
        body["segments"] = [
            {
                "id": s.id,
                "seek": round(s.start_s * 100),
                "start": s.start_s,
                "end": s.end_s,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in segments
        ]
        if labels is not None:
            for segment, label in zip(body["segments"], labels):
                segment["speaker"] = label.speaker
    if with_words:
        # OpenAI's shape: one list for the whole file, each word without its leading space.
        body["words"] = [
            {"word": w.word.strip(), "start": w.start_s, "end": w.end_s}
            for s in segments
            for w in s.words or []
        ]
        if labels is not None:
            word_labels = [speaker for label in labels for speaker in label.word_speakers]
            for word, speaker in zip(body["words"], word_labels):
                word["speaker"] = speaker
    body["usage"] = duration_usage(transcription.duration_s)
    return body


def to_response(
    transcription: Transcription,
    response_format: str,
    task: str,
    timestamp_granularities: tuple[str, ...] = (),
    with_logprobs: bool = False,
    speakers: Speakers | None = None,
) -> Response:
    """``with_logprobs``: include[]=logprobs asked for each text token's log-probability (json only);
    ``speakers``: the request was diarized (diarized_json, or verbose_json with diarize=true)."""
    if response_format == "text":
        return PlainTextResponse(transcription.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(to_srt(segments_of(transcription)), media_type="application/x-subrip")
    if response_format == "vtt":
        return PlainTextResponse(to_vtt(segments_of(transcription)), media_type="text/vtt")
    if response_format == "verbose_json":
        with_words = "word" in timestamp_granularities
        with_segments = not timestamp_granularities or "segment" in timestamp_granularities
        return JSONResponse(to_verbose_json(transcription, task, with_words, with_segments, speakers))
    if response_format == "diarized_json":
        return JSONResponse(to_diarized_json(transcription, speakers))
    body = {"text": transcription.text, "languages": languages_of(transcription)}
    if with_logprobs:
        body["logprobs"] = logprobs_of_windows(transcription.windows)
    body["usage"] = duration_usage(transcription.duration_s)
    return JSONResponse(body)
