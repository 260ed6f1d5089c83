"""The HTTP front door, as a Serve deployment: OpenAI's audio routes, API keys, load shedding and
metrics, and each request sent to the model its `model` field names (deployments/served_models.py).
What a request's fields mean (deployments/http/forms.py), how its windows reach the encoder and
decoder (deployments/orchestration/pipeline.py), how it answers (deployments/http/formats.py,
streaming.py) and which status each error gets (deployments/http/errors.py) live in deployments/http.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.

import asyncio
import contextlib
import dataclasses
import logging
import time
from functools import partial

from fastapi import FastAPI, Request, WebSocket
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.http.api_keys import APIKeys
from deployments.http.audio_ingest import AudioIngest
from deployments.http.channels import to_channel_response
from deployments.http.errors import (
    add_exception_handlers,
    api_error_of,
    at_capacity,
    error_response,
    model_not_found,
)
from deployments.http.formats import to_response
from deployments.http.forms import TranscriptionForm, parse_transcription_form
from deployments.http.pending_uploads import PendingUploads
from deployments.http.readiness import Readiness, models_readiness, not_ready
from deployments.http.realtime import CLOSE_INTERNAL_ERROR, CLOSE_TRY_AGAIN_LATER, RealtimeSession
from deployments.http.realtime_events import RealtimeEventError, error_event
from deployments.http.realtime_speakers import LiveSpeakers
from deployments.http.server_timing import ServerTiming
from deployments.http.speakers import decode_references, diarized_speakers
from deployments.http.streaming import StreamContents, transcription_events
from deployments.metrics import ServingMetrics, api_key_label
from deployments.orchestration.channels import transcribe_channels
from deployments.orchestration.diarization import DiarizationClient
from deployments.orchestration.partial_schedule import PartialSchedule
from deployments.routing import SessionRoutingStats
from deployments.served_models import ServedModel, ServedModels
from engine import SAMPLE_RATE, long_form_cursor
from engine.types import Priority

# FastAPI's own schema and docs routes are off: the Ingress serves them itself, behind the API key
# like every route but /health and /ready.
app = FastAPI(
    title="whisper-disagg",
    description="OpenAI-compatible Whisper transcription on Ray Serve",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)
add_exception_handlers(app)

logger = logging.getLogger("ray.serve")


def _model_object(name: str) -> dict:
    """OpenAI's model object."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "whisper-disagg"}


@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        config: AppConfig,
        handles: dict[str, tuple[DeploymentHandle | None, DeploymentHandle]],
        diarizer: DeploymentHandle | None = None,
    ):
        """``handles``: each model's (encoder, decoder) deployments by model name; an encoder None:
        colocated, the model's decoder replicas encode their own windows. ``diarizer``: the app's
        diarizer deployment (config `diarizer`), or None."""
        self.config = config
        self.models = ServedModels.of(config, handles)
        self.api_keys = APIKeys(config.http.api_keys)
        self.diarization = DiarizationClient(diarizer) if diarizer is not None else None
        self.diarizer_readiness = Readiness.of_diarizer(self.diarization) if self.diarization else None
        self.metrics = ServingMetrics()
        self.in_flight = 0  # requests this replica is working on; bounded by http.max_in_flight_requests
        self.pending_uploads = PendingUploads(
            config.http.max_pending_uploads,
            config.http.max_pending_uploads_per_address,
            config.http.min_upload_bytes_per_s,
        )
        self.realtime_sessions = 0  # open WebSocket sessions; bounded by realtime.max_sessions
        self.partial_schedule = PartialSchedule(config.realtime.max_partial_passes_in_flight)
        self.audio = AudioIngest(config.http)

    # ---- routes -------------------------------------------------------------------------------

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request) -> Response:
        return await self._handle(request, task="transcribe")

    @app.post("/v1/audio/translations")
    async def translations(self, request: Request) -> Response:
        return await self._handle(request, task="translate")

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        self.api_keys.authorize(request)
        return JSONResponse({"object": "list", "data": [_model_object(name) for name in self.models.ids]})

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        self.api_keys.authorize(request)
        self._served(model_id)
        return JSONResponse(_model_object(model_id))

    @app.websocket("/v1/realtime")
    async def realtime(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols") or []
        authorization = websocket.headers.get("authorization", "")
        if not self.api_keys.accepted(authorization, offered):
            await websocket.close(code=1008)  # before the upgrade: the client gets HTTP 403
            return
        # Browsers authenticate with a subprotocol; the handshake must then echo one they offered.
        await websocket.accept(subprotocol="realtime" if "realtime" in offered else None)
        refusal = None
        if websocket.query_params.get("intent") != "transcription":
            refusal = (
                RealtimeEventError(
                    "unsupported_intent",
                    "This server speaks transcription sessions only: ?intent=transcription.",
                ),
                1008,
            )
        elif self.realtime_sessions >= self.config.realtime.max_sessions:
            refusal = (
                RealtimeEventError(
                    "session_limit_reached",
                    f"The server holds all the sessions it can ({self.config.realtime.max_sessions} "
                    "per replica); retry shortly.",
                ),
                CLOSE_TRY_AGAIN_LATER,
            )
        if refusal is not None:
            await websocket.send_json(error_event(refusal[0]))
            await websocket.close(code=refusal[1])
            return
        self.realtime_sessions += 1
        self.metrics.realtime_sessions.inc()
        try:
            session = RealtimeSession(
                websocket,
                self.config.realtime,
                self.models,
                self.metrics,
                self.partial_schedule,
                api_key_label(self.api_keys.presented(authorization, offered)),
                LiveSpeakers(self.diarization),
            )
            await session.run()
        except Exception:
            # A fault of the server's (not of the client's events, which get error events): say so
            # in OpenAI's shape and close with 1011 rather than drop the connection without a word.
            logger.exception("realtime session failed")
            error = RealtimeEventError("server_error", "The server failed this session; open a new one.")
            with contextlib.suppress(Exception):  # the client may be gone already
                await websocket.send_json(error_event(error))
                await websocket.close(code=CLOSE_INTERNAL_ERROR)
        finally:
            self.realtime_sessions -= 1
            self.metrics.realtime_sessions.dec()

    def record_routing_stats(self) -> dict[str, int]:
        """Serve calls this every realtime.routing_stats_period_s: deployments/routing.py spreads by it."""
        return SessionRoutingStats(self.realtime_sessions, self.config.realtime.max_sessions).as_dict()

    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(self, model: str | None = None) -> Response:
        """Every model's readiness and the diarizer's, or with `?model=` that one model's."""
        chosen = self.models if model is None else [self._served(model)]
        ready, states = models_readiness({served.name: served.readiness for served in chosen})
        body = {"models": states}
        diarizer = None
        if model is None and self.diarizer_readiness is not None:
            diarizer = body["diarizer"] = self.diarizer_readiness.state()
            ready = ready and diarizer["ready"]
        if not ready:
            error = not_ready(states, diarizer)
            headers = {"Retry-After": str(error.retry_after_s)}
            return JSONResponse({"error": error.body(), **body}, status_code=503, headers=headers)
        warmed_up = [*states.values(), *([diarizer] if diarizer else [])]
        warm_up_s = max(state["warm_up_s"] for state in warmed_up)
        return JSONResponse({"status": "ready", "warm_up_s": warm_up_s, **body})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        # A scraper sends the key as a bearer token (Prometheus: authorization).
        self.api_keys.authorize(request)
        self.metrics.decoded_audio_seconds.set(self.audio.decoded_audio.held_s)
        diarizer_figures, *figures = await asyncio.gather(
            self.diarization.replica_stats() if self.diarization else asyncio.sleep(0, []),
            *(served.replica_stats() for served in self.models),
        )
        body = self.metrics.render(
            {served.name: stats for served, stats in zip(self.models, figures)}, diarizer_figures
        )
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema(self, request: Request) -> Response:
        self.api_keys.authorize(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger_docs(self, request: Request) -> Response:
        # With keys set a browser cannot send one, so these pages load only for a client that can
        # (curl); the schema at /openapi.json is the same document.
        self.api_keys.authorize(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc_docs(self, request: Request) -> Response:
        self.api_keys.authorize(request)
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    # ---- the work -----------------------------------------------------------------------------

    def _served(self, model_id: str) -> ServedModel:
        """The model a request's `model` names; an unknown one is a 404."""
        served = self.models.named(model_id)
        if served is None:
            raise model_not_found(model_id, self.models.ids)
        return served

    async def _handle(self, request: Request, task: str) -> Response:
        route = "translations" if task == "translate" else "transcriptions"
        started = time.perf_counter()
        phases = ServerTiming()
        try:
            api_key = self.api_keys.authorize(request)
            # The body arrives first, holding only a place among the pending uploads: a client that
            # sends slowly, or not at all, takes no in-flight slot from those whose bodies came.
            form = await parse_transcription_form(request, task, self.config, self.pending_uploads)
        except Exception as error:
            api_error = api_error_of(error)
            self._observe(route, None, started, api_error.status)
            return error_response(api_error)
        phases.mark("upload")
        if self.in_flight >= self.config.http.max_in_flight_requests:
            # Shed load before the audio is decoded: memory stays bounded and admitted requests
            # keep their latency, instead of every request slowing down together.
            self._observe(route, None, started, 503)
            return error_response(at_capacity())
        self.in_flight += 1
        try:
            return await self._transcription_response(form, api_key, task, route, started, phases)
        finally:
            self.in_flight -= 1

    async def _transcription_response(
        self,
        form: TranscriptionForm,
        api_key: str,
        task: str,
        route: str,
        started: float,
        phases: ServerTiming,
    ) -> Response:
        served = None  # the model, once the form's name is resolved
        speakers = None  # the recording's diarization under way, when the request asks for speakers
        try:
            served = self._served(form.model)
            await served.check_options(form.options)
            phases.mark("options")
            if form.split_channels:
                response, audio_s = await self._channels_response(served, form, task, phases)
                self._observe(route, served.name, started, 200, audio_s, api_key=api_key)
                return response
            references = None
            if form.speakers is not None and form.speakers.references:
                references = await asyncio.to_thread(
                    decode_references, form.speakers.references, self.audio.decoder.decode
                )
            audio = await asyncio.to_thread(self.audio.mono, form.data, form.speech)
            phases.mark("audio")
            if form.speakers is not None:
                # Diarized beside the windows, not after them: a diarized request takes about as long
                # as a plain one while the diarizer has capacity.
                speakers = asyncio.ensure_future(
                    diarized_speakers(
                        self.diarization, audio.samples, audio.vad_pass, form.speakers, references
                    )
                )
            form = self._prioritize(form, len(audio.samples) / SAMPLE_RATE)
            cursor = long_form_cursor(audio.samples, form.options, form.long_form, audio.windows)
            if form.stream:
                # A streamed request counts against max_in_flight_requests until its stream starts,
                # not to its end: a generator that a vanished client never starts could not give
                # its place back.
                events = transcription_events(
                    served.pipeline.decoded(cursor, form.priority),
                    cursor,
                    partial(self._observe, route, served.name, started, api_key=api_key),
                    StreamContents(
                        segments=form.response_format in ("verbose_json", "diarized_json"),
                        words="word" in form.timestamp_granularities,
                        logprobs=form.options.token_logprobs,
                    ),
                    speakers,
                )
                speakers = None  # the stream owns it now
                return StreamingResponse(events, media_type="text/event-stream")
            transcription = await served.pipeline.transcribe(cursor, form.priority)
            phases.mark("windows")
            on_transcript = None
            if speakers is not None:
                on_transcript = await speakers
                phases.mark("speakers")
            response = to_response(
                transcription,
                form.response_format,
                task,
                form.timestamp_granularities,
                form.options.token_logprobs,
                on_transcript,
            )
            phases.mark("format")
            response.headers["server-timing"] = phases.header()
        except Exception as error:  # every failure answers, in OpenAI's error format
            api_error = api_error_of(error)
            self._observe(route, served and served.name, started, api_error.status)
            return error_response(api_error)
        finally:
            if speakers is not None:
                speakers.cancel()  # done already, or the windows failed first and its answer is not wanted
        self._observe(route, served.name, started, 200, transcription.duration_s, api_key=api_key)
        return response

    async def _channels_response(
        self, served: ServedModel, form: TranscriptionForm, task: str, phases: ServerTiming
    ) -> tuple[Response, float]:
        """channels=split: each channel transcribed on its own, then one answer with each segment
        labelled with its channel; and the audio's duration, the usage it reports."""
        channels = await asyncio.to_thread(self.audio.channels, form.data, form.speech)
        phases.mark("audio")
        duration_s = len(channels[0].samples) / SAMPLE_RATE
        form = self._prioritize(form, duration_s)
        cursors = [
            long_form_cursor(channel.samples, form.options, form.long_form, channel.windows)
            for channel in channels
        ]
        transcriptions = await transcribe_channels(served.pipeline, cursors, form.priority)
        phases.mark("windows")
        response = JSONResponse(
            to_channel_response(
                transcriptions, duration_s, form.response_format, task, form.timestamp_granularities
            )
        )
        phases.mark("format")
        response.headers["server-timing"] = phases.header()
        return response, duration_s

    def _prioritize(self, form: TranscriptionForm, duration_s: float) -> TranscriptionForm:
        """Give the request its priority class if it asked for none."""
        if form.priority is not None:
            return form
        interactive = duration_s <= self.config.http.interactive_max_duration_s
        return dataclasses.replace(form, priority=Priority.INTERACTIVE if interactive else Priority.BATCH)

    def _observe(
        self,
        route: str,
        model: str | None,
        started: float,
        status: int,
        audio_s: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        """A request answered. ``model``: the served model's name; None before a request names one
        (never a name a client made up: the label's values stay the configured models). One answered
        200 adds its audio seconds to its model's and API key label's usage (the figure its response
        reported)."""
        self.metrics.observe_request(route, model or "", status, time.perf_counter() - started)
        if status == 200 and model is not None and api_key is not None:
            self.metrics.observe_usage(model, api_key, audio_s)
