"""A realtime transcription session on `GET /v1/realtime?intent=transcription`: OpenAI's Realtime
API events over one WebSocket (deployments/http/realtime_events.py), audio cut into turns by the
server's VAD (engine/transcribe/turn_detection.py) or by the client's commits, and each turn's
passes run by a ``LiveTurn`` (deployments/orchestration/live_turn.py) through the model the session
chose (`transcription.model`; until it chooses, the app's default model). A turn keeps the model it
opened with, and its audio seconds bill that model under the session's API key label, as a file's do.

The session reads client events in one loop and never waits for a pass there: passes run as tasks
beside it, a ticker offers the open turn a partial pass every ``realtime.partial_interval_ms``
(LiveTurn.offer_partial_pass), and final passes are chained so that turns complete in order.
When the client goes away, passes still out run to their end and free what they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import numpy as np
from fastapi.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from deployments.config import RealtimeOptions
from deployments.http.errors import api_error_of
from deployments.http.formats import duration_usage, logprobs_of
from deployments.http.realtime_events import (
    RealtimeEventError,
    SessionSettings,
    decode_audio_chunk,
    error_event,
    new_id,
    parse_json_frame,
    server_event,
    session_event,
    transcription_param,
    updated_settings,
)
from deployments.http.realtime_speakers import LiveSpeakers
from deployments.http.realtime_vad import ServerVadTurns
from deployments.metrics import ServingMetrics
from deployments.orchestration.live_turn import LiveTurn, TurnSettings
from deployments.orchestration.partial_schedule import PartialSchedule
from deployments.served_models import ServedModel, ServedModels
from engine import IdleTimedOut, SpeechStarted
from engine.errors import quoted
from engine.types import DecodeOptions

logger = logging.getLogger("ray.serve")

CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013  # RFC 6455: the server is overloaded
CLOSE_INTERNAL_ERROR = 1011  # RFC 6455: the server met a condition it did not expect


class RealtimeSession:
    def __init__(
        self,
        websocket: WebSocket,
        options: RealtimeOptions,
        models: ServedModels,
        metrics: ServingMetrics,
        partial_schedule: PartialSchedule,
        api_key: str,
        speakers: LiveSpeakers,
    ):
        """``api_key``: the label (metrics.api_key_label) of the key the client connected with."""
        self.partial_schedule = partial_schedule  # the replica's, shared by its sessions
        self.api_key = api_key
        self.websocket = websocket
        self.options = options
        self.models = models
        self.metrics = metrics
        self.session_id = new_id("sess")
        self.settings = SessionSettings()
        self.speakers = speakers
        self.vad: ServerVadTurns | None = None  # None: the client commits each turn
        self.turn: LiveTurn | None = None
        self._received_samples = 0  # audio appended so far, at the client's rate
        self._last_item_id: str | None = None
        self._final: asyncio.Task | None = None  # the newest turn's final pass; each awaits the one before
        self._tasks: set[asyncio.Task] = set()
        self._send_lock = asyncio.Lock()
        self._opened_s = time.monotonic()
        self._configure_turn_detection()

    async def run(self) -> None:
        """Serve the session until the client goes away or is idle too long; then free everything."""
        await self.emit(self._session_event("session.created"))
        ticker = asyncio.create_task(self._partial_passes())
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.websocket.receive(), self.options.idle_timeout_s)
                except asyncio.TimeoutError:
                    error = RealtimeEventError(
                        "idle_timeout",
                        f"No event for {self.options.idle_timeout_s:g} s; closing the session.",
                    )
                    await self.emit(error_event(error))
                    await self.websocket.close(CLOSE_NORMAL)
                    return
                if message["type"] == "websocket.disconnect":
                    return
                await self._handle(message)
        except WebSocketDisconnect:
            return
        finally:
            ticker.cancel()
            self._release()

    async def emit(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            # Once the client has gone, nothing: Serve's proxy would fail on the closed socket.
            if self.websocket.client_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client is going
                    await self.websocket.send_text(json.dumps(event))

    # ---- client events ------------------------------------------------------------------------

    async def _handle(self, message: dict[str, Any]) -> None:
        event: Any = None
        try:
            event = parse_json_frame(message)
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeEventError("invalid_event", "An event is a JSON object with a `type`.", "type")
            handler = self._handlers.get(event["type"])
            if handler is None:
                raise RealtimeEventError(
                    "unknown_event_type",
                    f"Unknown or unsupported event type {quoted(event['type'])} in a transcription session.",
                    "type",
                )
            await handler(self, event)
        except RealtimeEventError as error:
            client_event_id = event.get("event_id") if isinstance(event, dict) else None
            await self.emit(error_event(error, client_event_id))

    async def _update(self, event: dict[str, Any]) -> None:
        settings = updated_settings(self.settings, event, self.models.ids)
        self.speakers.check(settings, event["type"])
        if self.turn is not None and settings.audio_format != self.settings.audio_format:
            raise RealtimeEventError(
                "invalid_value",
                "The audio format cannot change while a turn is open; commit or clear the buffer first.",
                "session.input_audio_format",
            )
        if (settings.language, settings.model) != (self.settings.language, self.settings.model):
            try:  # the language must be one the (new) model decodes
                await self._model(settings).check_options(DecodeOptions(language=settings.language))
            except Exception as error:
                raise RealtimeEventError(
                    "invalid_value",
                    api_error_of(error).message,
                    transcription_param(event["type"], "language"),
                ) from None
        # The detector's resampler follows the audio format's rate.
        detection_changed = (settings.turn_detection, settings.audio_format) != (
            self.settings.turn_detection,
            self.settings.audio_format,
        )
        self.settings = settings
        if detection_changed:
            self._configure_turn_detection()
        reply = "session.updated"
        if event["type"].startswith("transcription"):
            reply = "transcription_session.updated"
        await self.emit(self._session_event(reply))

    async def _append(self, event: dict[str, Any]) -> None:
        samples = decode_audio_chunk(event, self.settings.audio_format)
        rate = self.settings.sample_rate_hz
        ahead_s = (self._received_samples + len(samples)) / rate - (time.monotonic() - self._opened_s)
        if ahead_s > self.options.max_audio_ahead_s:
            raise RealtimeEventError(
                "audio_too_fast",
                f"Audio is arriving {ahead_s:.1f} s ahead of real time (at most "
                f"{self.options.max_audio_ahead_s:g} s); this chunk was dropped. Stream audio live.",
                "audio",
            )
        self._received_samples += len(samples)
        if self.vad is None:
            if self.turn is None:
                self.turn = self._new_turn()
            self.turn.append(samples)
        else:
            await self._detect_turns(samples)
        if self.turn is not None and self.turn.duration_s >= self.options.max_turn_s:
            await self._commit(speech_ended_s=time.perf_counter())

    async def _commit_event(self, event: dict[str, Any]) -> None:
        if self.turn is None or self.turn.num_samples == 0:
            raise RealtimeEventError(
                "input_audio_buffer_commit_empty", "Cannot commit an empty input audio buffer."
            )
        await self._commit(speech_ended_s=time.perf_counter())

    async def _clear(self, event: dict[str, Any]) -> None:
        if self.turn is not None:
            self.turn.cancel()
            self.turn = None
        self._end_detected_turn()
        await self.emit(server_event("input_audio_buffer.cleared"))

    _handlers = {
        "session.update": _update,
        "transcription_session.update": _update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit_event,
        "input_audio_buffer.clear": _clear,
    }

    # ---- turns --------------------------------------------------------------------------------

    def _model(self, settings: SessionSettings) -> ServedModel:
        """The model the settings name (every update checks that it is served), or the default one."""
        return self.models.named(settings.model) if settings.model else self.models.default

    def _session_event(self, event_type: str) -> dict[str, Any]:
        """The settings in force, naming the model the next turn goes to as the client named it (or,
        before it names one, by the default model's name)."""
        model = self.settings.model or self.models.default.name
        return session_event(event_type, self.session_id, self.settings, model)

    def _configure_turn_detection(self) -> None:
        vad = self.settings.turn_detection
        self.vad = ServerVadTurns(vad, self.settings.sample_rate_hz, self._received_samples) if vad else None

    async def _detect_turns(self, samples: np.ndarray) -> None:
        turn = self.turn
        turn_events = self.vad.feed(samples, between_turns=turn is None)
        if turn is not None:
            turn.append(samples, speech=self.vad.heard_speech)
        for turn_event in turn_events:
            if isinstance(turn_event, SpeechStarted):
                await self._start_detected_turn(self.vad.sample_of(turn_event.audio_start_s))
            elif isinstance(turn_event, IdleTimedOut):
                if self.turn is None:  # else a turn the client opened before detection was switched on
                    await self._commit_quiet(turn_event)
            elif self.turn is not None:
                await self.emit(
                    server_event(
                        "input_audio_buffer.speech_stopped",
                        audio_end_ms=self.vad.ms_of(turn_event.audio_end_s),
                        item_id=self.turn.item_id,
                    )
                )
                await self._commit(speech_ended_s=time.perf_counter())
        if self.turn is None:
            self.vad.trim()

    async def _start_detected_turn(self, start: int) -> None:
        start, padded_audio = self.vad.take(start)
        self.turn = self._new_turn()
        self.turn.append(padded_audio)
        audio_start_ms = round(start / self.settings.sample_rate_hz * 1000)
        await self.emit(
            server_event(
                "input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=self.turn.item_id
            )
        )

    async def _commit_quiet(self, quiet: IdleTimedOut) -> None:
        """No speech for `idle_timeout_ms` (of audio, see IdleTimedOut): `timeout_triggered`, then
        the quiet stretch is committed as a turn of its own, as OpenAI commits it, and transcribed
        if the file endpoint's speech detection finds speech too soft for the session's VAD in it
        (else its transcript is empty, as a file's silence is)."""
        rate = self.settings.sample_rate_hz
        start, quiet_audio = self.vad.take(
            self.vad.sample_of(quiet.audio_start_s), self.vad.sample_of(quiet.audio_end_s)
        )
        turn = self._new_turn()
        turn.append(quiet_audio)
        await self.emit(
            server_event(
                "input_audio_buffer.timeout_triggered",
                audio_start_ms=round(start / rate * 1000),
                audio_end_ms=round((start + len(quiet_audio)) / rate * 1000),
                item_id=turn.item_id,
            )
        )
        await self._complete(turn, speech_ended_s=time.perf_counter(), speech_only=True)

    def _end_detected_turn(self) -> None:
        """A turn ended (speech stopped, commit, clear): the next one's audio starts after it."""
        if self.vad is not None:
            self.vad.end_turn()

    def _new_turn(self) -> LiveTurn:
        """A turn with the session's settings now, on the model the session now names."""
        item_id = new_id("item")

        async def send_delta(delta: str) -> None:
            await self.emit(
                server_event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item_id,
                    content_index=0,
                    delta=delta,
                )
            )

        settings = TurnSettings(
            self.settings.sample_rate_hz,
            self.settings.language,
            self.settings.prompt,
            self.settings.include_logprobs,
        )
        served = self._model(self.settings)
        return LiveTurn(
            item_id,
            served.name,
            settings,
            served.pipeline,
            send_delta,
            self.metrics,
            self.partial_schedule,
            served.realtime or self.options,  # as the model's device wants its partial passes encoded
        )

    async def _commit(self, speech_ended_s: float) -> None:
        """Close the open turn (speech stopped, the client committed, or it reached max_turn_s)."""
        turn, self.turn = self.turn, None
        self._end_detected_turn()
        await self._complete(turn, speech_ended_s)

    async def _complete(self, turn: LiveTurn, speech_ended_s: float, speech_only: bool = False) -> None:
        """Announce the turn committed and chain its final pass after the previous turn's
        (``speech_only``: see LiveTurn.finish)."""
        await self.emit(
            server_event(
                "input_audio_buffer.committed", previous_item_id=self._last_item_id, item_id=turn.item_id
            )
        )
        self._last_item_id = turn.item_id
        if self.settings.diarize:
            self.speakers.embed(turn.item_id, turn.samples_16k())
        self._final = self._spawn(self._finish(turn, self._final, speech_ended_s, speech_only))

    async def _finish(
        self, turn: LiveTurn, previous: asyncio.Task | None, speech_ended_s: float, speech_only: bool
    ) -> None:
        voice = self.speakers.take(turn.item_id)
        try:
            transcript = await turn.finish(speech_only)
        except Exception as error:
            if previous is not None:
                await asyncio.wait([previous])
            await self.emit(
                server_event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=turn.item_id,
                    content_index=0,
                    error=api_error_of(error).body(),
                )
            )
            return
        if previous is not None:
            await asyncio.wait([previous])  # turns complete in the order they were spoken
        # Counted before the client hears of it: once it has the event, /metrics has the seconds.
        self.metrics.observe_usage(turn.model_name, self.api_key, turn.duration_s)
        completed = server_event(
            "conversation.item.input_audio_transcription.completed",
            item_id=turn.item_id,
            content_index=0,
            transcript=transcript.text,
            usage=duration_usage(turn.duration_s),
        )
        if transcript.token_logprobs is not None:
            # The final passes' tokens: the transcript's, but for words partial passes committed
            # earlier and the final pass heard differently (deltas are never taken back).
            completed["logprobs"] = logprobs_of(transcript.token_logprobs)
        if voice is not None:  # labelled in the order spoken, as the session's speakers follow its turns
            completed["speaker"] = self.speakers.label(await voice)
        await self.emit(completed)
        self.metrics.observe_final(time.perf_counter() - speech_ended_s)

    async def _partial_passes(self) -> None:
        while True:
            await asyncio.sleep(self.options.partial_interval_ms / 1000)
            if self.turn is not None:
                self.turn.offer_partial_pass()

    def _spawn(self, work) -> asyncio.Task:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _release(self) -> None:
        """The session is over. Passes still out run to their end (cancelling one between encoder
        and decoder would strand its staged K/V until the staging times out): each then frees its
        blocks, and whatever it would send goes nowhere."""
        if self.turn is not None:
            self.turn.cancel()
