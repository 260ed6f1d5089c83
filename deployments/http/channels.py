"""Channels as speakers: the vendor field ``channels: "split"`` transcribes each channel of a
recording on its own and labels each segment with its channel.

Call recordings are often stereo with one party a channel; there the channel says who speaks
exactly, with no diarizer and no speaker model, and an overlap (both parties at once) is two
clean transcripts instead of one garbled one. Each channel's windows go through the same encoder
and decoder deployments as every other request's, so they share batches with everything else.

The answer is one transcript in time order: every channel's segments (and words) together,
sorted by start, each carrying its ``channel`` (0 for the first) and, as a speaker label, the
channel's letter (``A`` for channel 0, ``B`` for channel 1, ...). Formats with segments only
(verbose_json, diarized_json): the others have no segment to label.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import FormData

from deployments.http.errors import APIError
from deployments.http.formats import diarized_segment, duration_usage, to_verbose_json
from deployments.http.segments import Segment, segments_of
from deployments.http.speakers import SpokenSegment, letter_label
from engine import Transcription
from engine.errors import quoted

CHANNEL_MODES = ("mix", "split")
# Each channel costs a whole transcription; beyond a handful a file is a multitrack recording, not
# a call, and mixing it is the better answer.
MAX_SPLIT_CHANNELS = 8
SPLIT_FORMATS = ("verbose_json", "diarized_json")


def parse_channels(form: FormData, response_format: str, stream: bool) -> bool:
    """The vendor field ``channels``: "mix" (the default: channels mixed to mono, as OpenAI's API
    does) or "split"; True for split."""
    mode = form.get("channels") or "mix"
    if mode not in CHANNEL_MODES:
        raise APIError(400, f"Invalid channels {quoted(mode)}; expected 'mix' or 'split'.", param="channels")
    if mode == "mix":
        return False
    if response_format not in SPLIT_FORMATS:
        raise APIError(
            400,
            f"channels=split labels each segment with its channel; response_format "
            f"{quoted(response_format)} has no segments: send {' or '.join(SPLIT_FORMATS)}.",
            param="channels",
        )
    if stream:
        raise APIError(
            400,
            "channels=split is answered whole, not streamed; send it without stream=true.",
            param="channels",
        )
    return True


def check_channel_count(channels: int) -> None:
    if channels > MAX_SPLIT_CHANNELS:
        raise APIError(
            400,
            f"channels=split transcribes each channel on its own; this file has {channels} channels "
            f"and the most split is {MAX_SPLIT_CHANNELS}. Send it with channels=mix.",
            param="channels",
        )


def channel_label(channel: int) -> str:
    return letter_label(channel)


@dataclass(frozen=True)
class ChannelSegment:
    channel: int
    segment: Segment


def channel_segments(transcriptions: list[Transcription]) -> list[ChannelSegment]:
    """Every channel's segments in time order (a tie goes to the lower channel)."""
    tagged = [
        ChannelSegment(channel, segment)
        for channel, transcription in enumerate(transcriptions)
        for segment in segments_of(transcription)
    ]
    return sorted(tagged, key=lambda item: (item.segment.start_s, item.channel))


def _text(ordered: list[ChannelSegment]) -> str:
    return " ".join(item.segment.text.strip() for item in ordered if item.segment.text.strip())


def to_channel_diarized_json(transcriptions: list[Transcription], duration_s: float) -> dict:
    """diarized_json with each channel a speaker: the segments in time order, each with its
    channel's label as ``speaker`` and its ``channel``."""
    ordered = channel_segments(transcriptions)
    segments = []
    for index, item in enumerate(ordered):
        spoken = SpokenSegment(
            index,
            item.segment.start_s,
            item.segment.end_s,
            item.segment.text,
            channel_label(item.channel),
            None,
        )
        segments.append({**diarized_segment(spoken), "channel": item.channel})
    return {
        "task": "transcribe",
        "duration": round(duration_s, 3),
        "text": _text(ordered),
        "segments": segments,
        "usage": duration_usage(duration_s),
    }


def to_channel_verbose_json(
    transcriptions: list[Transcription],
    duration_s: float,
    task: str,
    granularities: tuple[str, ...],
) -> dict:
    """verbose_json of every channel in one: its segments and words in time order, each with its
    ``channel`` and the channel's label as ``speaker``; the language of the first channel that
    has text."""
    with_words = "word" in granularities
    with_segments = not granularities or "segment" in granularities
    bodies = [to_verbose_json(t, task, with_words, with_segments) for t in transcriptions]
    body = {
        "task": task,
        "language": next((b["language"] for b in bodies if b["text"].strip()), bodies[0]["language"]),
        "duration": round(duration_s, 3),
        "text": _text(channel_segments(transcriptions)),
    }
    if with_segments:
        tagged = [
            {**segment, "channel": channel, "speaker": channel_label(channel)}
            for channel, one in enumerate(bodies)
            for segment in one["segments"]
        ]
        tagged.sort(key=lambda segment: (segment["start"], segment["channel"]))
        body["segments"] = [{**segment, "id": index} for index, segment in enumerate(tagged)]
    if with_words:
        words = [
            {**word, "channel": channel, "speaker": channel_label(channel)}
            for channel, one in enumerate(bodies)
            for word in one["words"]
        ]
        body["words"] = sorted(words, key=lambda word: (word["start"], word["channel"]))
    body["usage"] = duration_usage(duration_s)
    return body


def to_channel_response(
    transcriptions: list[Transcription],
    duration_s: float,
    response_format: str,
    task: str,
    granularities: tuple[str, ...],
) -> dict:
    """The body of a channels=split request's answer (``parse_channels`` allows only these two)."""
    if response_format == "diarized_json":
        return to_channel_diarized_json(transcriptions, duration_s)
    return to_channel_verbose_json(transcriptions, duration_s, task, granularities)
