"""OpenAI's Realtime API for transcription sessions, as JSON on the wire: the session's settings
(both dialects: `transcription_session.update` of the beta API and `session.update` with
`type: "transcription"` of the GA one, which the current `openai` client sends), the audio formats,
the server events, and ``RealtimeEventError``: a bad client event, answered with an `error` event.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.http.errors import bounded_message
from engine import g711_to_float, pcm16_to_float
from engine.errors import AudioDecodeError, quoted

AudioFormat = Literal["pcm16", "g711_ulaw", "g711_alaw"]
# The GA API names the same formats by MIME type.
GA_FORMATS: dict[str, AudioFormat] = {
    "audio/pcm": "pcm16",
    "audio/pcmu": "g711_ulaw",
    "audio/pcma": "g711_alaw",
}
SAMPLE_RATES_HZ: dict[AudioFormat, int] = {"pcm16": 24000, "g711_ulaw": 8000, "g711_alaw": 8000}
# The one `include` value of a transcription session: each completed turn's token log-probabilities.
LOGPROBS_INCLUDE = "item.input_audio_transcription.logprobs"
_Include = list[Literal["item.input_audio_transcription.logprobs"]] | None


class RealtimeEventError(Exception):
    """A client event the session cannot take; the session answers with an `error` event and goes on."""

    def __init__(self, code: str, message: str, param: str | None = None):
        message = bounded_message(message)
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(frozen=True)
class ServerVAD:
    """OpenAI's server_vad settings, with its defaults."""

    threshold: float = 0.5  # speech probability above which a frame is speech
    prefix_padding_ms: int = 300  # audio kept before the detected start of speech
    silence_duration_ms: int = 500  # silence that ends a turn
    idle_timeout_ms: int | None = None  # no speech for this long commits the quiet stretch as a turn


@dataclass(frozen=True)
class SessionSettings:
    audio_format: AudioFormat = "pcm16"
    model: str | None = None  # the id the client chose (a name or an alias); None: the default model
    language: str | None = None
    prompt: str | None = None
    turn_detection: ServerVAD | None = ServerVAD()  # None: the client commits each turn
    include_logprobs: bool = False  # `include: ["item.input_audio_transcription.logprobs"]`
    diarize: bool = False  # `transcription.diarize` (a vendor field): a speaker on each completed turn

    @property
    def sample_rate_hz(self) -> int:
        return SAMPLE_RATES_HZ[self.audio_format]


# ---- client events ----------------------------------------------------------------------------


class _Lenient(BaseModel):
    # Fields this server does not use (noise_reduction, create_response, ...) are accepted and ignored, as
    # a client written for OpenAI sends them.
    model_config = ConfigDict(extra="ignore")


class _Transcription(_Lenient):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    diarize: bool | None = None


class _TurnDetection(_Lenient):
    type: Literal["server_vad"]
    threshold: float | None = Field(None, ge=0, le=1)
    prefix_padding_ms: int | None = Field(None, ge=0, le=10_000)
    silence_duration_ms: int | None = Field(None, ge=0, le=10_000)
    # At most two minutes: the quiet stretch is held to be transcribed when it times out.
    idle_timeout_ms: int | None = Field(None, ge=100, le=120_000)


class _GAFormat(_Lenient):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None


class _GAInput(_Lenient):
    format: _GAFormat | None = None
    transcription: _Transcription | None = None
    turn_detection: _TurnDetection | None = None


class _GAAudio(_Lenient):
    input: _GAInput | None = None


class _GASession(_Lenient):
    type: Literal["transcription"]
    audio: _GAAudio | None = None
    include: _Include = None


class _BetaSession(_Lenient):
    input_audio_format: AudioFormat | None = None
    input_audio_transcription: _Transcription | None = None
    turn_detection: _TurnDetection | None = None
    include: _Include = None


def parse_json_frame(message: dict[str, Any]) -> Any:
    """A WebSocket message's JSON: a client event, if it is an object with a `type`."""
    if message.get("text") is None:
        raise RealtimeEventError("invalid_event", "Events are JSON text frames, not binary ones.")
    try:
        return json.loads(message["text"])
    except json.JSONDecodeError as error:
        raise RealtimeEventError("invalid_json", f"The event is not valid JSON: {error}") from None


def transcription_param(event_type: str, name: str) -> str:
    """Where a transcription field (model, language, prompt, diarize) sits in the update event's dialect,
    for an error's `param`."""
    if event_type == "session.update":
        return f"session.audio.input.transcription.{name}"
    return f"session.input_audio_transcription.{name}"


def updated_settings(
    settings: SessionSettings, event: dict[str, Any], model_names: Collection[str]
) -> SessionSettings:
    """The settings after a `session.update` or `transcription_session.update`: fields it gives
    replace the current ones; `turn_detection: null` switches to manual commits."""
    session = event.get("session")
    if not isinstance(session, dict):
        raise RealtimeEventError("invalid_value", "The event needs a `session` object.", param="session")
    try:
        if event["type"] == "session.update":
            parsed = _GASession.model_validate(session)
            audio_input = parsed.audio.input if parsed.audio and parsed.audio.input else _GAInput()
            given = _given(session, "audio", "input")
            audio_format = GA_FORMATS[audio_input.format.type] if audio_input.format else None
            transcription, turn_detection = audio_input.transcription, audio_input.turn_detection
            include = parsed.include
        else:
            beta = _BetaSession.model_validate(session)
            given = session
            audio_format, transcription = beta.input_audio_format, beta.input_audio_transcription
            turn_detection, include = beta.turn_detection, beta.include
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(["session", *(str(part) for part in first["loc"])])
        raise RealtimeEventError(
            "invalid_value", f"Invalid value for {quoted(param)}: {first['msg']}", param
        ) from None
    changes: dict[str, Any] = {}
    if audio_format is not None:
        changes["audio_format"] = audio_format
    if transcription is not None:
        if transcription.model is not None and transcription.model not in model_names:
            raise RealtimeEventError(
                "model_not_found",
                f"The model {quoted(transcription.model)} is not served here; use one of "
                f"{', '.join(model_names)}.",
                param=transcription_param(event["type"], "model"),
            )
        fields = transcription.model_fields_set & {"model", "language", "prompt"}
        changes.update({name: getattr(transcription, name) or None for name in fields if name != "model"})
        if "model" in fields and transcription.model:
            changes["model"] = transcription.model
        if transcription.diarize is not None:
            changes["diarize"] = transcription.diarize
    if "turn_detection" in given:
        changes["turn_detection"] = _server_vad(turn_detection) if turn_detection else None
    if "include" in session:
        changes["include_logprobs"] = LOGPROBS_INCLUDE in (include or [])
    return dataclasses.replace(settings, **changes)


def _given(session: dict, *path: str) -> dict:
    for key in path:
        session = session.get(key) if isinstance(session, dict) else None
    return session if isinstance(session, dict) else {}


def _server_vad(given: _TurnDetection) -> ServerVAD:
    defaults = ServerVAD()
    return ServerVAD(
        **{
            name: getattr(given, name) if getattr(given, name) is not None else getattr(defaults, name)
            for name in ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")
        }
    )


def decode_audio_chunk(event: dict[str, Any], audio_format: AudioFormat) -> np.ndarray:
    """An `input_audio_buffer.append` event's base64 audio -> float32 samples at the format's rate."""
    encoded = event.get("audio")
    if not isinstance(encoded, str):
        raise RealtimeEventError("invalid_value", "The event needs `audio`, a base64 string.", param="audio")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeEventError("invalid_base64", "`audio` is not valid base64.", param="audio") from None
    try:
        if audio_format == "pcm16":
            return pcm16_to_float(data)
        return g711_to_float(data, audio_format.removeprefix("g711_"))
    except AudioDecodeError as error:
        raise RealtimeEventError(
            "invalid_audio_format", f"`audio` is not {audio_format} audio: {error}", param="audio"
        ) from None


# ---- server events ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def server_event(event_type: str, **fields: Any) -> dict[str, Any]:
    return {"type": event_type, "event_id": new_id("event"), **fields}


def error_event(error: RealtimeEventError, client_event_id: str | None = None) -> dict[str, Any]:
    return server_event(
        "error",
        error={
            "type": "invalid_request_error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "event_id": client_event_id,
        },
    )


def session_event(event_type: str, session_id: str, settings: SessionSettings, model: str) -> dict[str, Any]:
    """`session.created`/`.updated` (GA shape) or `transcription_session.updated` (beta shape).
    ``model``: the id of the model the session's next turn goes to (the one it chose, or the
    default model's name)."""
    transcription = {
        "model": model,
        "language": settings.language,
        "prompt": settings.prompt or "",
        "diarize": settings.diarize,
    }
    include = [LOGPROBS_INCLUDE] if settings.include_logprobs else None
    vad = settings.turn_detection
    turn_detection = {"type": "server_vad", **dataclasses.asdict(vad)} if vad else None
    if event_type.startswith("transcription_session."):
        session = {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": settings.audio_format,
            "input_audio_transcription": transcription,
            "turn_detection": turn_detection,
            "input_audio_noise_reduction": None,
            "include": include,
        }
    else:
        ga_format = {name: mime for mime, name in GA_FORMATS.items()}[settings.audio_format]
        audio_format = {"type": ga_format, **({"rate": 24000} if ga_format == "audio/pcm" else {})}
        session = {
            "type": "transcription",
            "id": session_id,
            "object": "realtime.transcription_session",
            "audio": {
                "input": {
                    "format": audio_format,
                    "transcription": transcription,
                    "turn_detection": turn_detection,
                    "noise_reduction": None,
                }
            },
            "include": include,
        }
    return server_event(event_type, session=session)
