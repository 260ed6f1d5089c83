"""A transcription or translation request's multipart body -> a validated ``TranscriptionForm``:
the audio bytes, the ``DecodeOptions`` its fields ask for, and how to answer. Every field that is
wrong answers with an ``APIError`` naming it, as OpenAI's API does.
"""

import json
from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import FormData

from deployments.config import AppConfig
from deployments.http.channels import parse_channels
from deployments.http.errors import APIError, model_not_found
from deployments.http.fields import list_field, parse_flag, parse_number
from deployments.http.formats import RESPONSE_FORMATS
from deployments.http.pending_uploads import PendingUploads
from deployments.http.speakers import SpeakerOptions, parse_speaker_fields
from deployments.http.uploads import read_upload
from engine import LongFormMode, SpeechOptions
from engine.errors import quoted
from engine.types import DecodeOptions, FallbackOptions, Priority


@dataclass(frozen=True)
class TranscriptionForm:
    """The multipart fields of a transcription or translation request, validated."""

    data: bytes
    options: DecodeOptions
    response_format: str
    timestamp_granularities: tuple[str, ...]
    long_form: LongFormMode
    stream: bool
    priority: Priority | None  # None: by the audio's length (http.interactive_max_duration_s)
    speech: SpeechOptions | None  # chunking_strategy (or the server's default): windows from speech
    model: str  # the name of the model its `model` field chooses (by that name or an alias)
    speakers: SpeakerOptions | None = None  # diarized_json or diarize=true: who speaks, too
    split_channels: bool = False  # channels=split: each channel transcribed and labelled on its own


def _parse_threshold(raw, name: str, default: float | None) -> float | None:
    """A fallback threshold (a vendor field): a number, or 'none' to not check it."""
    if raw in (None, ""):
        return default
    if str(raw).lower() == "none":
        return None
    try:
        return float(raw)
    except ValueError:
        raise APIError(
            400, f"Invalid {name} {quoted(raw)}; expected a number or 'none'.", param=name
        ) from None


def _parse_temperature(raw) -> float:
    if raw in (None, ""):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise APIError(
            400, f"Invalid temperature {quoted(raw)}; expected a number between 0 and 1.", param="temperature"
        ) from None
    if not 0.0 <= value <= 1.0:
        raise APIError(
            400, f"Invalid temperature {value}; expected a number between 0 and 1.", param="temperature"
        )
    return value


# Formats a stream can carry: text deltas (json, text), and segment events too (verbose_json).
STREAMED_FORMATS = ("json", "text", "verbose_json", "diarized_json")

# Request fields that exist for benchmarks only: accepted with `http.benchmark_fields: true`.
BENCHMARK_FIELDS = ("fixed_output_tokens",)


def _refuse_benchmark_fields(form, config: AppConfig) -> None:
    if config.http.benchmark_fields:
        return
    for name in BENCHMARK_FIELDS:
        if name in form:
            raise APIError(
                400,
                f"The field {quoted(name)} is for benchmarks only and this server does not accept it "
                "(its config has http.benchmark_fields off); send the request without it.",
                param=name,
            )


def _parse_fixed_output_tokens(raw) -> int | None:
    """The benchmark-only vendor field `fixed_output_tokens`: every window decodes exactly this many
    tokens, end of text or not, with no fallback, so that random weights (which never stop on their
    own) and real ones cost a known amount of decoding. Not for transcripts: the text goes on past
    the speech."""
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise APIError(
            400,
            f"Invalid fixed_output_tokens {quoted(raw)}; expected a whole number of at least 1.",
            param="fixed_output_tokens",
        )
    return value


def _parse_beam_options(form: FormData, config: AppConfig) -> dict:
    """The vendor fields `beam_size`, `patience`, `length_penalty` and `best_of` (openai-whisper's
    meaning: beams at temperature 0, the best of `best_of` samples at the fallback's higher ones)."""
    beam_size = parse_number(
        form.get("beam_size"), "beam_size", int, 1, config.largest_beam_size, config.http.default_beam_size
    )
    patience = parse_number(form.get("patience"), "patience", float, 0.1, 10.0, None)
    if patience is not None and beam_size == 1:
        raise APIError(400, "patience needs beam_size greater than 1.", param="patience")
    length_penalty = parse_number(form.get("length_penalty"), "length_penalty", float, 0.0, 1.0, None)
    best_of = parse_number(form.get("best_of"), "best_of", int, 1, config.largest_beam_size, 1)
    return dict(beam_size=beam_size, patience=patience, length_penalty=length_penalty, best_of=best_of)


def _parse_priority(raw) -> Priority | None:
    """The vendor field `priority` (interactive | batch); absent: chosen by the audio's length."""
    if raw in (None, ""):
        return None
    try:
        return Priority(raw)
    except ValueError:
        raise APIError(
            400, f"Invalid priority {quoted(raw)}; expected 'interactive' or 'batch'.", param="priority"
        ) from None


_SERVER_VAD_FIELDS = {"threshold": float, "prefix_padding_ms": int, "silence_duration_ms": int}
# What OpenAI's API documents for the server_vad fields a client leaves out. "auto" instead takes
# SpeechOptions' defaults, tuned for offline Whisper (longer regions: whole sentences per region).
_SERVER_VAD_DEFAULTS = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 200}
_CHUNKING = "chunking_strategy"
# This server's own value: no speech detection, every stretch decoded in windows cut at quiet
# points. OpenAI's API has no way to say it (its client drops a None field), and with
# http.vad_by_default on an absent field means speech detection.
_NO_SPEECH_DETECTION = "none"


def _chunking_fields(form: FormData) -> dict | str | None:
    """OpenAI's ``chunking_strategy`` as sent: "auto", a JSON object (curl), or the bracketed fields
    the official client flattens an object into (``chunking_strategy[type]=server_vad``)."""
    nested = {
        key[len(_CHUNKING) + 1 : -1]: value for key, value in form.items() if key.startswith(f"{_CHUNKING}[")
    }
    raw = form.get(_CHUNKING)
    if nested:
        return nested
    if raw in (None, ""):
        return None
    if str(raw).strip().startswith("{"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise APIError(400, f"Invalid {_CHUNKING}: not valid JSON.", param=_CHUNKING) from None
        if not isinstance(value, dict):
            raise APIError(400, f'Invalid {_CHUNKING}: expected "auto" or an object.', param=_CHUNKING)
        return value
    return str(raw)


def _parse_chunking_strategy(form: FormData, default: SpeechOptions | None) -> SpeechOptions | None:
    """ "auto" or {"type": "server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms"}:
    windows packed from detected speech; "none": windows cut at quiet points, no speech detection
    (None); absent: the server's default (http.vad_by_default)."""
    fields = _chunking_fields(form)
    if fields is None:
        return default
    if fields == "auto":
        return SpeechOptions()
    if fields == _NO_SPEECH_DETECTION:
        return None
    if isinstance(fields, str):
        raise APIError(
            400,
            f'Invalid {_CHUNKING} {quoted(fields)}; expected "auto", a server_vad object or '
            f'"{_NO_SPEECH_DETECTION}".',
            param=_CHUNKING,
        )
    if fields.get("type") != "server_vad":
        raise APIError(
            400,
            f"Invalid {_CHUNKING}.type {quoted(fields.get('type'))}; expected 'server_vad'.",
            param=_CHUNKING,
        )
    values = dict(_SERVER_VAD_DEFAULTS)
    for name, raw in fields.items():
        if name == "type":
            continue
        kind = _SERVER_VAD_FIELDS.get(name)
        if kind is None:
            raise APIError(
                400,
                f"Unknown {_CHUNKING} field {quoted(name)}; expected {', '.join(_SERVER_VAD_FIELDS)}.",
                param=_CHUNKING,
            )
        try:
            value = kind(float(raw)) if kind is int else kind(raw)
        except (TypeError, ValueError):
            value = None
        valid = value is not None and (0.0 <= value <= 1.0 if name == "threshold" else value >= 0)
        if not valid:
            expected = (
                "a number from 0 to 1" if name == "threshold" else "a whole number of milliseconds >= 0"
            )
            raise APIError(
                400, f"Invalid {_CHUNKING}.{name} {quoted(raw)}; expected {expected}.", param=_CHUNKING
            )
        values[name] = value
    return SpeechOptions(**values)


def _parse_words_list(form: FormData, name: str) -> tuple[str, ...] | None:
    """``languages[]`` or ``keywords[]``: each item once, in the order sent; absent: None. Whether
    the model can use them is the engine's to say (a 400 naming the field)."""
    items = [str(item).strip() for item in list_field(form, name)]
    if any(not item for item in items):
        raise APIError(400, f"Invalid {name}: an item is empty.", param=name)
    return tuple(dict.fromkeys(items)) or None


def _parse_granularities(form: FormData, response_format: str) -> tuple[str, ...]:
    """``timestamp_granularities[]``, as OpenAI's API takes them: 'segment' with any format (only
    verbose_json shows it), 'word' with verbose_json only, where the words have a place."""
    granularities = tuple(list_field(form, "timestamp_granularities"))
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise APIError(
                400,
                f"Invalid timestamp_granularities value {quoted(granularity)}; expected 'segment' or 'word'.",
                param="timestamp_granularities[]",
            )
    if "word" in granularities and response_format != "verbose_json":
        raise APIError(
            400,
            "timestamp_granularities[]=word is only supported with response_format verbose_json, "
            f"not {quoted(response_format)}.",
            param="timestamp_granularities[]",
        )
    return granularities


def _parse_include(form: FormData, response_format: str) -> bool:
    """``include[]``: only 'logprobs', which, as in OpenAI's API, needs response_format json."""
    include = list_field(form, "include")
    for item in include:
        if item != "logprobs":
            raise APIError(
                400, f"Invalid include value {quoted(item)}; expected 'logprobs'.", param="include[]"
            )
    if include and response_format != "json":
        raise APIError(
            400,
            f"include[]=logprobs is only available with response_format json, not {quoted(response_format)}.",
            param="include[]",
        )
    return bool(include)


async def parse_transcription_form(
    request: Request, task: str, config: AppConfig, pending: PendingUploads
) -> TranscriptionForm:
    """``pending``: the uploads arriving at this replica, the body's place among them while it comes."""
    form, data = await read_upload(request, config, pending)

    model = form.get("model")
    if not model:
        raise APIError(400, "Missing required field 'model'.", param="model")
    served = config.model_named(model)
    if served is None:
        raise model_not_found(model, config.accepted_model_names)
    config = config.serving(served)  # the model's limits: its beams fit its decoders' sequences

    _refuse_benchmark_fields(form, config)
    response_format = form.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"Invalid response_format {quoted(response_format)}; expected one of "
            f"{', '.join(RESPONSE_FORMATS)}.",
            param="response_format",
        )
    temperature = _parse_temperature(form.get("temperature"))
    granularities = _parse_granularities(form, response_format)
    language = form.get("language") or None
    if task == "translate":
        language = None  # translations detect the spoken language and always output English
    # The languages the audio may be in: detection (a translation's too) chooses among them.
    languages = _parse_words_list(form, "languages")
    stream = parse_flag(form.get("stream"), "stream", False)
    if stream and response_format not in STREAMED_FORMATS:
        raise APIError(
            400,
            f"stream=true gives text and segment events; response_format {quoted(response_format)} cannot "
            f"be streamed (use {', '.join(STREAMED_FORMATS)}).",
            param="stream",
        )
    long_form = form.get("long_form") or "parallel"  # vendor field
    if long_form not in ("parallel", "sequential"):
        raise APIError(
            400,
            f"Invalid long_form {quoted(long_form)}; expected 'parallel' or 'sequential'.",
            param="long_form",
        )
    # The server's default applies to parallel long-form only: sequential seeks through all the audio.
    vad_by_default = config.http.vad_by_default and long_form == "parallel"
    speech = _parse_chunking_strategy(form, SpeechOptions() if vad_by_default else None)
    if speech is not None and long_form == "sequential":
        raise APIError(
            400,
            f"{_CHUNKING} cuts the audio where speech is; long_form 'sequential' seeks through all of "
            "it instead. Send one of the two.",
            param=_CHUNKING,
        )
    # As OpenAI's API: temperature 0 falls back to higher temperatures when a window's text
    # fails openai-whisper's thresholds; the vendor fields tune or switch that off.
    fallback = None
    if parse_flag(form.get("temperature_fallback"), "temperature_fallback", True):
        defaults = FallbackOptions()
        fallback = FallbackOptions(
            **{
                name: _parse_threshold(form.get(name), name, getattr(defaults, name))
                for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold")
            }
        )
    split_channels = parse_channels(form, response_format, stream)
    speakers = parse_speaker_fields(form, response_format, task, granularities, config, split_channels)
    # Formats with segment times ask the decoder for Whisper's timestamp tokens (as does
    # sequential long-form, which seeks by them); word times come with verbose_json, and with
    # diarization, which gives each word to a speaker and cuts segments where the speaker changes.
    timestamps = response_format in ("srt", "vtt", "verbose_json") or speakers is not None or split_channels
    words = "word" in granularities or speakers is not None
    fixed_tokens = _parse_fixed_output_tokens(form.get("fixed_output_tokens"))
    if fixed_tokens is not None:
        fallback = None  # a retry would decode the window again: the count would not be known
    options = DecodeOptions(
        language=language,
        languages=languages,
        task=task,
        prompt=form.get("prompt") or None,
        keywords=_parse_words_list(form, "keywords"),
        temperature=temperature,
        timestamps=timestamps,
        fallback=fallback,
        word_timestamps=words,
        max_tokens=fixed_tokens,
        ignore_eot=fixed_tokens is not None,
        token_logprobs=_parse_include(form, response_format),
        **_parse_beam_options(form, config),
    )
    return TranscriptionForm(
        data,
        options,
        response_format,
        granularities,
        long_form,
        stream,
        _parse_priority(form.get("priority")),
        speech,
        served.name,
        speakers,
        split_channels,
    )
