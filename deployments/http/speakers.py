"""Speakers in the HTTP API: what a diarized request asks for (``SpeakerOptions``), its known
speakers' reference clips decoded and checked, and speaker labels put on a transcript's segments.

OpenAI's rules for ``known_speaker_references[]``: data URLs of 2 to 10 seconds of audio each, in
any format the file may be in, up to 4, one per ``known_speaker_names[]``. A speaker whose voice
matches a reference takes its name; the others are lettered A, B, ... in the order they first
speak in the transcript.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from starlette.datastructures import FormData

from deployments.config import AppConfig
from deployments.diarizer import DiarizerJob
from deployments.http.errors import APIError
from deployments.http.fields import list_field, parse_flag, parse_number
from deployments.http.segments import Segment
from deployments.orchestration.diarization import DiarizationClient
from engine import SAMPLE_RATE, DiarizationRequest, SpeakerTurn, speaker_at, split_by_speaker
from engine.errors import AudioDecodeError, AudioTooLongError, quoted
from engine.types import TimedText, TimedWord

# Bounds min_speakers / max_speakers may set: beyond any conversation clustering tells apart.
MAX_SPEAKERS = 32
MAX_KNOWN_SPEAKERS = 4
REFERENCE_MIN_S = 2.0
REFERENCE_MAX_S = 10.0
NAMES_FIELD = "known_speaker_names[]"
REFERENCES_FIELD = "known_speaker_references[]"
_DATA_URL = re.compile(r"data:(?P<media>[^;,]*)(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class SpeakerOptions:
    """A diarized request's speaker fields: bounds on the count and the known speakers' reference
    audio (still encoded, as sent) by name."""

    min_speakers: int | None = None
    max_speakers: int | None = None
    references: dict[str, bytes] | None = None


def parse_known_speakers(names: list[str], references: list[str]) -> dict[str, bytes] | None:
    """``known_speaker_names[]`` and ``known_speaker_references[]`` -> each name's reference bytes;
    None when neither is sent. The audio itself is checked later (``decode_references``)."""
    if not names and not references:
        return None
    if not references:
        raise APIError(
            400,
            f"{NAMES_FIELD} needs a {REFERENCES_FIELD} (a data URL of audio) for each name.",
            param=NAMES_FIELD,
        )
    if not names:
        raise APIError(
            400, f"{REFERENCES_FIELD} needs a {NAMES_FIELD} entry naming each reference.", param=NAMES_FIELD
        )
    if len(names) != len(references):
        raise APIError(
            400,
            f"{NAMES_FIELD} has {len(names)} entries and {REFERENCES_FIELD} {len(references)}; send one "
            "reference per name.",
            param=REFERENCES_FIELD,
        )
    if len(references) > MAX_KNOWN_SPEAKERS:
        raise APIError(
            400,
            f"{REFERENCES_FIELD} has {len(references)} references; at most {MAX_KNOWN_SPEAKERS} known "
            "speakers are supported.",
            param=REFERENCES_FIELD,
        )
    cleaned = [name.strip() for name in names]
    if any(not name for name in cleaned):
        raise APIError(400, f"{NAMES_FIELD}: a name is empty.", param=NAMES_FIELD)
    if len(set(cleaned)) < len(cleaned):
        raise APIError(400, f"{NAMES_FIELD}: each name must be given once.", param=NAMES_FIELD)
    return {
        name: _data_url_bytes(reference, index)
        for index, (name, reference) in enumerate(zip(cleaned, references))
    }


def parse_speaker_fields(
    form: FormData,
    response_format: str,
    task: str,
    granularities: tuple[str, ...],
    config: AppConfig,
    split_channels: bool = False,
) -> SpeakerOptions | None:
    """The speaker fields: OpenAI's diarized_json with ``known_speaker_names[]`` and
    ``known_speaker_references[]``, and the vendor fields ``diarize`` (speakers on verbose_json),
    ``min_speakers`` and ``max_speakers``. None: the diarizer is not asked (the request is not
    diarized, or ``split_channels``: its channels are its speakers). OpenAI's diarizing model
    refuses a prompt and timestamp_granularities; so does diarized_json here."""
    diarize = parse_flag(form.get("diarize"), "diarize", False)
    names, references = (
        list_field(form, "known_speaker_names"),
        list_field(form, "known_speaker_references"),
    )
    given = {
        "known_speaker_names[]": bool(names),
        "known_speaker_references[]": bool(references),
        "min_speakers": form.get("min_speakers") not in (None, ""),
        "max_speakers": form.get("max_speakers") not in (None, ""),
    }
    if response_format != "diarized_json" and not diarize:
        for name, sent in given.items():
            if sent:
                raise APIError(
                    400,
                    f"{name} is for diarized requests: send response_format diarized_json (or diarize=true "
                    "with verbose_json).",
                    param=name,
                )
        return None
    if diarize and response_format not in ("verbose_json", "diarized_json"):
        raise APIError(
            400,
            f"diarize=true puts speakers on verbose_json segments and words, not on "
            f"{quoted(response_format)}; "
            "send response_format verbose_json, or diarized_json for OpenAI's diarized format.",
            param="diarize",
        )
    if split_channels:
        for name, sent in given.items():
            if sent:
                raise APIError(
                    400,
                    f"{name} is for the diarizer; with channels=split each channel is one speaker. "
                    "Send one of the two.",
                    param=name,
                )
    elif config.diarizer is None:
        raise APIError(
            400,
            "This server does not diarize: its config has no `diarizer` section. Send another "
            "response_format.",
            param="response_format",
            code="diarization_unavailable",
        )
    if task == "translate":
        raise APIError(
            400,
            "Translations cannot be diarized; send diarized requests to /v1/audio/transcriptions.",
            param="response_format",
        )
    if response_format == "diarized_json":
        if granularities:
            raise APIError(
                400,
                "timestamp_granularities[] is not supported with response_format diarized_json.",
                param="timestamp_granularities[]",
            )
        if form.get("prompt"):
            raise APIError(400, "prompt is not supported with response_format diarized_json.", param="prompt")
    if split_channels:
        return None
    min_speakers = parse_number(form.get("min_speakers"), "min_speakers", int, 1, MAX_SPEAKERS, None)
    max_speakers = parse_number(form.get("max_speakers"), "max_speakers", int, 1, MAX_SPEAKERS, None)
    if min_speakers and max_speakers and min_speakers > max_speakers:
        raise APIError(
            400,
            f"min_speakers ({min_speakers}) is more than max_speakers ({max_speakers}).",
            param="min_speakers",
        )
    return SpeakerOptions(min_speakers, max_speakers, parse_known_speakers(names, references))


def _data_url_bytes(reference: str, index: int) -> bytes:
    match = _DATA_URL.fullmatch(reference.strip())
    if match is None:
        shown = reference[:40] + ("..." if len(reference) > 40 else "")
        raise APIError(
            400,
            f"{REFERENCES_FIELD} item {index} is not a base64 data URL of audio "
            f"(data:audio/wav;base64,...): it begins '{shown}'.",
            param=REFERENCES_FIELD,
        )
    try:
        return base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400,
            f"{REFERENCES_FIELD} item {index}: the data URL's base64 data is invalid.",
            param=REFERENCES_FIELD,
        ) from None


def decode_references(
    references: dict[str, bytes], decode: Callable[[bytes, float], np.ndarray]
) -> dict[str, np.ndarray]:
    """Each known speaker's reference as 16 kHz samples; a 400 naming the field for a reference
    that is not audio or is not 2 to 10 seconds long. ``decode``: the ingress's decoding processes'
    (a client's audio is never decoded in the replica's own process), or decode_audio. Blocking:
    run it off the event loop."""
    decoded = {}
    for index, (name, data) in enumerate(references.items()):
        where = f"{REFERENCES_FIELD} item {index} ({quoted(name)})"
        try:
            # Decoding stops as soon as the reference is longer than any accepted one.
            samples = decode(data, REFERENCE_MAX_S)
            duration_s = len(samples) / SAMPLE_RATE
        except AudioTooLongError:
            duration_s = None
        except AudioDecodeError as error:
            raise APIError(400, f"{where} is not audio: {error}.", param=REFERENCES_FIELD) from None
        if duration_s is None or not REFERENCE_MIN_S <= duration_s <= REFERENCE_MAX_S:
            held = f"more than {REFERENCE_MAX_S:g}" if duration_s is None else f"{duration_s:.1f}"
            raise APIError(
                400,
                f"{where} holds {held} s of audio; a reference must be between "
                f"{REFERENCE_MIN_S:g} and {REFERENCE_MAX_S:g} seconds.",
                param=REFERENCES_FIELD,
            )
        decoded[name] = samples
    return decoded


async def diarized_speakers(
    diarization: DiarizationClient,
    samples: np.ndarray,
    vad_pass: np.ndarray | None,
    options: SpeakerOptions,
    references: dict[str, np.ndarray] | None,
) -> Speakers:
    """A recording's speakers from the diarizer deployment, ready to put on its transcript.
    ``vad_pass``: the ingress's Silero pass over ``samples`` (None when it ran none), handed on
    so that the diarizer reads its speech regions from it instead of running the model again."""
    request = DiarizationRequest(samples, options.min_speakers, options.max_speakers, vad_pass)
    timeline = await diarization.diarize(DiarizerJob(request, references or {}))
    if timeline.silent_references:
        raise APIError(
            400,
            f"{REFERENCES_FIELD} for {', '.join(timeline.silent_references)} holds no speech to "
            "take a voice from; send 2 to 10 seconds of that speaker talking.",
            param=REFERENCES_FIELD,
        )
    return Speakers(timeline.turns, timeline.names)


@dataclass(frozen=True)
class SpokenSegment:
    """A transcript segment said by one speaker, on the file's timeline, with its label; its words
    (file timeline) where the segment had word timings."""

    id: int
    start_s: float
    end_s: float
    text: str
    speaker: str
    words: list[TimedWord] | None


@dataclass(frozen=True)
class SegmentSpeakers:
    """A verbose_json segment's speaker (who talks most during it) and each of its words'."""

    speaker: str
    word_speakers: list[str]


def letter_label(index: int) -> str:
    """A, B, ..., Z, AA, AB, ...: the label of the index-th unnamed speaker."""
    label = ""
    index += 1
    while index:
        index, remainder = divmod(index - 1, 26)
        label = chr(ord("A") + remainder) + label
    return label


class Speakers:
    """A recording's speaker turns put on its transcript. Labels go out in the order speakers first
    appear in the transcript: a known speaker's name, else the next letter. One object serves a
    whole response (a stream labels its later segments as it labelled the earlier ones)."""

    def __init__(self, turns: list[SpeakerTurn], names: dict[int, str]):
        self.turns = turns
        self.names = names
        self._labels: dict[int | None, str] = {}

    def label(self, speaker: int | None) -> str:
        label = self._labels.get(speaker)
        if label is None:
            lettered = sum(1 for known in self._labels if known not in self.names)
            label = (self.names.get(speaker) if speaker is not None else None) or letter_label(lettered)
            self._labels[speaker] = label
        return label

    def spoken_segments(self, segments: list[Segment], first_id: int = 0) -> list[SpokenSegment]:
        """Each segment cut where the speaker changes (by its words' times), each piece labelled;
        ids count on from ``first_id``."""
        spoken: list[SpokenSegment] = []
        for segment in segments:
            words = [TimedWord(w.word, w.start_s, w.end_s, []) for w in segment.words or []]
            timed = TimedText(
                segment.start_s, segment.end_s, segment.text, segment.tokens, words=words or None
            )
            for piece in split_by_speaker(timed, self.turns):
                spoken.append(
                    SpokenSegment(
                        first_id + len(spoken),
                        round(piece.start_s, 3),
                        round(piece.end_s, 3),
                        piece.text,
                        self.label(piece.speaker),
                        piece.words if segment.words is not None else None,
                    )
                )
        return spoken

    def segment_speakers(self, segments: list[Segment]) -> list[SegmentSpeakers]:
        """Speakers for verbose_json with diarize=true: segments stay whole, as Whisper cut them."""
        speakers = []
        for segment in segments:
            words = [self.label(speaker_at(w.start_s, w.end_s, self.turns)) for w in segment.words or []]
            segment_speaker = self.label(speaker_at(segment.start_s, segment.end_s, self.turns))
            speakers.append(SegmentSpeakers(segment_speaker, words))
        return speakers
