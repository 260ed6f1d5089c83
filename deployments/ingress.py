"""The HTTP front door: OpenAI's audio routes, validation, errors as OpenAI's error JSON, metrics.

Every error type raised anywhere below is turned into a status code here, in one table
(``_status_of``), so the same failure always answers the same way.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.http.formats import RESPONSE_FORMATS, to_srt, to_verbose_json, to_vtt, segments_of
from deployments.metrics import ServingMetrics
from deployments.encoder import WindowJob
from engine.model.audio import SAMPLE_RATE, decode_audio
from engine.errors import AudioDecodeError, RequestRejectedError, RetriableError
from engine.types import DecodeOptions, DecodeResult, FallbackOptions, FinishReason, Priority
from engine.transcribe.windows import (
    AudioWindow, LongFormMode, SequentialCursor, Transcription, assemble_transcription, split_windows,
)
from kv_transfer.base import StagingFullError

logger = logging.getLogger("ray.serve")

app = FastAPI(title="whisper-disagg", description="OpenAI-compatible Whisper transcription on Ray Serve")

# A window is tried this many times (encoded again each time) before the request fails with 503.
WINDOW_ATTEMPTS = 3
# What a replica that died or is restarting looks like to its caller.
REPLICA_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised inside route handlers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.retry_after_s = error_type, retry_after_s


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    body = {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=headers)


def _status_of(error: Exception) -> APIError:
    if isinstance(error, RayTaskError) and isinstance(error.cause, Exception):
        error = error.cause  # raised in another replica: answer for the original error, not Ray's wrapper
    if isinstance(error, APIError):
        return error
    if isinstance(error, AudioDecodeError):
        return APIError(400, f"Invalid audio file: {error}", param="file", code="invalid_audio")
    if isinstance(error, RequestRejectedError):
        return APIError(400, str(error), param=error.param, code="invalid_request")
    if isinstance(error, (BackPressureError, StagingFullError)):
        return APIError(503, "The server is at capacity; retry shortly.", code="overloaded",
                        error_type="server_overloaded", retry_after_s=1)
    if isinstance(error, REPLICA_LOST):
        return APIError(503, "A server replica is restarting; retry shortly.", code="replica_unavailable",
                        error_type="server_error", retry_after_s=2)
    if isinstance(error, RetriableError):
        return APIError(503, f"Transcription failed transiently: {error}", code="retry",
                        error_type="server_error", retry_after_s=1)
    logger.exception("unexpected error", exc_info=error)
    return APIError(500, "Internal server error.", error_type="server_error")


@app.exception_handler(APIError)
async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    field = str(first.get("loc", ["", "?"])[-1])
    return error_response(APIError(400, f"Invalid value for '{field}': {first.get('msg', 'invalid')}", param=field))


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


def _parse_flag(raw, name: str, default: bool) -> bool:
    if raw in (None, ""):
        return default
    if str(raw).lower() in ("true", "1"):
        return True
    if str(raw).lower() in ("false", "0"):
        return False
    raise APIError(400, f"Invalid {name} '{raw}'; expected true or false.", param=name)


def _parse_threshold(raw, name: str, default: float | None) -> float | None:
    """A fallback threshold (a vendor field): a number, or 'none' to not check it."""
    if raw in (None, ""):
        return default
    if str(raw).lower() == "none":
        return None
    try:
        return float(raw)
    except ValueError:
        raise APIError(400, f"Invalid {name} '{raw}'; expected a number or 'none'.", param=name) from None


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def _parse_temperature(raw) -> float:
    if raw in (None, ""):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise APIError(400, f"Invalid temperature '{raw}'; expected a number between 0 and 1.", param="temperature") from None
    if not 0.0 <= value <= 1.0:
        raise APIError(400, f"Invalid temperature {value}; expected a number between 0 and 1.", param="temperature")
    return value


def _parse_priority(raw) -> Priority | None:
    """The vendor field `priority` (interactive | batch); absent: chosen by the audio's length."""
    if raw in (None, ""):
        return None
    try:
        return Priority(raw)
    except ValueError:
        raise APIError(400, f"Invalid priority '{raw}'; expected 'interactive' or 'batch'.", param="priority") from None


@serve.ingress(app)
class Ingress:
    def __init__(self, config: AppConfig, encoder: DeploymentHandle, decoder: DeploymentHandle):
        self.config = config
        self.encoder = encoder
        self.decoder = decoder
        self.metrics = ServingMetrics()
        self.in_flight = 0  # requests this replica is working on; bounded by http.max_in_flight_requests

    # ---- routes -------------------------------------------------------------------------------

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request) -> Response:
        return await self._handle(request, task="transcribe")

    @app.post("/v1/audio/translations")
    async def translations(self, request: Request) -> Response:
        return await self._handle(request, task="translate")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        names = sorted(self.config.accepted_model_names)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "whisper-disagg"} for name in names
        ]})

    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        encoder_stats = await self.encoder.broadcast("stats").results_async(timeout_s=5, return_exceptions=True)
        decoder_stats = await self.decoder.broadcast("stats").results_async(timeout_s=5, return_exceptions=True)
        body = self.metrics.render(
            [s for s in encoder_stats if not isinstance(s, Exception)],
            [s for s in decoder_stats if not isinstance(s, Exception)],
        )
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    # ---- the work -----------------------------------------------------------------------------

    async def _handle(self, request: Request, task: str) -> Response:
        route = "translations" if task == "translate" else "transcriptions"
        started = time.perf_counter()
        if self.in_flight >= self.config.http.max_in_flight_requests:
            # Shed load before reading the body: memory stays bounded and admitted requests keep
            # their latency, instead of every request slowing down together.
            self.metrics.observe_request(route, 503, time.perf_counter() - started, 0.0)
            return error_response(APIError(503, "The server is at capacity; retry shortly.", code="overloaded",
                                           error_type="server_overloaded", retry_after_s=1))
        self.in_flight += 1
        try:
            return await self._transcription_response(request, task, route, started)
        finally:
            self.in_flight -= 1

    async def _transcription_response(self, request: Request, task: str, route: str, started: float) -> Response:
        try:
            self._authorize(request)
            form = await self._parse_form(request, task)
            await self.decoder.check_options.remote(form.options)
            samples = await asyncio.to_thread(decode_audio, form.data)
            duration_s = len(samples) / SAMPLE_RATE
            if duration_s > self.config.http.max_audio_duration_s:
                raise APIError(413, f"Audio is {duration_s:.0f} s long; this server accepts at most "
                               f"{self.config.http.max_audio_duration_s:.0f} s.", param="file", code="audio_too_long")
            if form.priority is None:
                interactive = duration_s <= self.config.http.interactive_max_duration_s
                form = dataclasses.replace(form, priority=Priority.INTERACTIVE if interactive else Priority.BATCH)
            if form.stream:
                return StreamingResponse(self._events(samples, form, route, started), media_type="text/event-stream")
            transcription = await self._transcribe(samples, form)
            response = self._format(transcription, form, task)
        except Exception as error:  # every failure answers, in OpenAI's error format
            api_error = _status_of(error)
            self.metrics.observe_request(route, api_error.status, time.perf_counter() - started, 0.0)
            return error_response(api_error)
        self.metrics.observe_request(route, 200, time.perf_counter() - started, transcription.duration_s)
        return response

    async def _transcribe(self, samples, form: TranscriptionForm) -> Transcription:
        windows, results = [], []
        async for window, result in self._decoded_windows(samples, form):
            windows.append(window)
            results.append(result)
        return assemble_transcription(samples, windows, results)

    async def _events(self, samples, form: TranscriptionForm, route: str, started: float) -> AsyncIterator[str]:
        """OpenAI's transcription stream: a ``transcript.text.delta`` as each window's text is
        ready, in order, then ``transcript.text.done``; the deltas join to the final text.

        A streamed request counts against ``max_in_flight_requests`` until its stream starts, not
        to its end: a generator that a vanished client never starts could not give its place back."""
        windows, results, streamed = [], [], ""
        try:
            async for window, result in self._decoded_windows(samples, form):
                windows.append(window)
                results.append(result)
                # The final text is the windows' text stripped at both ends; holding back trailing
                # spaces keeps every delta a piece of it.
                shown = "".join(r.text for r in results).strip()
                if len(shown) > len(streamed):
                    yield _sse({"type": "transcript.text.delta", "delta": shown[len(streamed):]})
                    streamed = shown
            transcription = assemble_transcription(samples, windows, results)
            yield _sse({"type": "transcript.text.done", "text": transcription.text})
        except Exception as error:  # the status line has gone out: the error travels as an event
            api_error = _status_of(error)
            self.metrics.observe_request(route, api_error.status, time.perf_counter() - started, 0.0)
            yield _sse({"type": "error", "error": {"message": api_error.message, "type": api_error.error_type,
                                                   "param": api_error.param, "code": api_error.code}})
            return
        self.metrics.observe_request(route, 200, time.perf_counter() - started, transcription.duration_s)

    async def _decoded_windows(self, samples, form: TranscriptionForm) -> AsyncIterator[tuple[AudioWindow, DecodeResult]]:
        """The file's windows and their results, in order, each as soon as it and those before it
        are decoded. Parallel: up to ``http.max_windows_in_flight`` windows are in flight at once,
        so they share encoder batches and decoder steps. Sequential: one window at a time, each prompted by the text before it."""
        request_id = uuid.uuid4().hex
        if form.long_form == "sequential":
            cursor = SequentialCursor(samples, form.options)
            while (step := cursor.next_window()) is not None:
                window, options = step
                result = await self._decode_window(f"{request_id}-{len(cursor.results)}", window.samples, options, form.priority)
                cursor.accept(window, result)
                yield cursor.windows[-1], cursor.results[-1]
            return
        windows = split_windows(samples)
        limit = self.config.http.max_windows_in_flight
        tasks: dict[int, asyncio.Future] = {}

        def start(index: int) -> None:
            if index < len(windows):
                tasks[index] = asyncio.ensure_future(
                    self._decode_window(f"{request_id}-{index}", windows[index].samples, form.options, form.priority))

        for index in range(limit):
            start(index)
        try:
            for index, window in enumerate(windows):
                result = await tasks.pop(index)
                start(index + limit)  # a sliding window: memory stays flat however long the file
                yield window, result
        finally:
            for task in tasks.values():
                task.cancel()  # a failed window or a client gone: stop decoding the others

    async def _decode_window(self, window_id: str, samples, options: DecodeOptions, priority: Priority) -> DecodeResult:
        """Encode and decode one window. A lost replica (killed, crashed, restarting) or a failed
        K/V transfer sends the window through the encoder again, to whichever replicas Serve
        routes it to now; only when every attempt fails does the request get a 503."""
        failure = "no attempt made"
        for attempt in range(WINDOW_ATTEMPTS):
            try:
                handle = await self.encoder.encode.remote(WindowJob(f"{window_id}-a{attempt}", samples, priority))
                result: DecodeResult = await self.decoder.decode.remote(handle, options, len(samples) / SAMPLE_RATE, priority)
            except REPLICA_LOST as error:
                failure = f"a replica was lost ({type(error).__name__})"
                logger.warning("window %s: %s; trying again (attempt %d)", window_id, failure, attempt + 1)
                continue
            if result.finish_reason != FinishReason.ERROR:
                return result
            if not result.retriable:
                raise RuntimeError(f"decoding window {window_id} failed: {result.error}")
            failure = result.error or "cross-attention K/V transfer failed"
            logger.warning("window %s: %s; encoding again (attempt %d)", window_id, failure, attempt + 1)
        raise RetriableError(f"window {window_id} failed {WINDOW_ATTEMPTS} times; last: {failure}")

    def _format(self, transcription: Transcription, form: TranscriptionForm, task: str) -> Response:
        if form.response_format == "text":
            return PlainTextResponse(transcription.text + "\n")
        if form.response_format == "srt":
            return PlainTextResponse(to_srt(segments_of(transcription)), media_type="application/x-subrip")
        if form.response_format == "vtt":
            return PlainTextResponse(to_vtt(segments_of(transcription)), media_type="text/vtt")
        if form.response_format == "verbose_json":
            return JSONResponse(to_verbose_json(transcription, task, with_words=form.options.word_timestamps))
        return JSONResponse({"text": transcription.text})

    # ---- validation ---------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        keys = self.config.http.api_keys
        if not keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if token not in keys:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def _parse_form(self, request: Request, task: str) -> TranscriptionForm:
        limit_bytes = int(self.config.http.max_upload_mb * 2**20)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit_bytes + 64 * 1024:
            raise APIError(413, f"Request body exceeds {self.config.http.max_upload_mb:g} MB.", param="file",
                           code="file_too_large")
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise APIError(400, "Send the audio as multipart/form-data with a 'file' field.", param="file")
        try:
            form = await asyncio.wait_for(request.form(max_files=1, max_fields=32), self.config.http.upload_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"The request body did not arrive within {self.config.http.upload_timeout_s:g} s.",
                           code="upload_timeout") from None
        except Exception as error:
            raise APIError(400, f"Could not parse the multipart body: {error}") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "Missing required field 'file' (the audio file).", param="file", code="missing_file")
        data = await upload.read()
        if len(data) > limit_bytes:
            raise APIError(413, f"File exceeds {self.config.http.max_upload_mb:g} MB.", param="file", code="file_too_large")

        model = form.get("model")
        if not model:
            raise APIError(400, "Missing required field 'model'.", param="model")
        if model not in self.config.accepted_model_names:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"{', '.join(sorted(self.config.accepted_model_names))}.", param="model", code="model_not_found")

        response_format = form.get("response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise APIError(400, f"Invalid response_format '{response_format}'; expected one of "
                           f"{', '.join(RESPONSE_FORMATS)}.", param="response_format")
        temperature = _parse_temperature(form.get("temperature"))
        granularities = tuple(form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities"))
        for granularity in granularities:
            if granularity not in ("segment", "word"):
                raise APIError(400, f"Invalid timestamp_granularities value '{granularity}'; expected "
                               "'segment' or 'word'.", param="timestamp_granularities[]")
        language = form.get("language") or None
        if task == "translate":
            language = None  # translations detect the spoken language and always output English
        stream = _parse_flag(form.get("stream"), "stream", False)
        if stream and response_format not in ("json", "text"):
            raise APIError(400, f"stream=true gives text events; response_format '{response_format}' cannot be "
                           "streamed (use json or text).", param="stream")
        long_form = form.get("long_form") or "parallel"  # vendor field
        if long_form not in ("parallel", "sequential"):
            raise APIError(400, f"Invalid long_form '{long_form}'; expected 'parallel' or 'sequential'.", param="long_form")
        beam_size = form.get("beam_size")  # vendor field
        if beam_size not in (None, "", "1"):
            raise APIError(400, "beam_size > 1 is not supported yet (greedy or sampled decoding only; see the README).",
                           param="beam_size")
        # As OpenAI's API: temperature 0 falls back to higher temperatures when a window's text
        # fails openai-whisper's thresholds; the vendor fields tune or switch that off.
        fallback = None
        if _parse_flag(form.get("temperature_fallback"), "temperature_fallback", True):
            defaults = FallbackOptions()
            fallback = FallbackOptions(**{
                name: _parse_threshold(form.get(name), name, getattr(defaults, name))
                for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold")
            })
        # Formats with segment times ask the decoder for Whisper's timestamp tokens (as does
        # sequential long-form, which seeks by them); words are only shown in verbose_json.
        timestamps = response_format in ("srt", "vtt", "verbose_json")
        words = "word" in granularities and response_format == "verbose_json"
        options = DecodeOptions(language=language, task=task, prompt=form.get("prompt") or None,
                                temperature=temperature, timestamps=timestamps, fallback=fallback, word_timestamps=words)
        return TranscriptionForm(data, options, response_format, granularities, long_form, stream,
                                 _parse_priority(form.get("priority")))

