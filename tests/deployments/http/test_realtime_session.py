"""A realtime session's own rules, over a real WebSocket (Starlette's test transport) without Ray:
the protocol around the passes, with a pipeline that answers every window with the same text and
records the options it was asked to decode with. The whole app over the official client is
tests/deployments/test_realtime.py."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.config import RealtimeOptions
from deployments.http.option_checks import AcceptedOptions
from deployments.http.realtime import CLOSE_NORMAL, RealtimeSession
from deployments.http.realtime_speakers import LiveSpeakers
from deployments.metrics import ANONYMOUS, ServingMetrics
from deployments.orchestration.partial_schedule import PartialSchedule
from deployments.served_models import ServedModel, ServedModels
from engine.errors import RequestRejectedError
from engine.types import DecodeOptions, DecodeResult, FinishReason, TokenLogprob

IDLE_TIMEOUT_S = 0.5
RATE_HZ = 24000  # pcm16, the session's default format
TEXT_TOKENS = [TokenLogprob(" Hello", -0.25), TokenLogprob(" there.", -0.5)]
COMPLETED = "conversation.item.input_audio_transcription.completed"


async def english_only(options: DecodeOptions) -> None:
    if options.language not in (None, "en"):
        raise RequestRejectedError(f"tiny.en does not know the language '{options.language}'.", "language")


class RecordingPipeline:
    """Stands in for the encoders and decoders: every window reads " Hello there."."""

    def __init__(self):
        self.calls: list[tuple[str, DecodeOptions]] = []  # (window id, options), as asked
        self.encoder_frames: dict[str, int | None] = {}  # window id -> the context it was asked over

    async def decode_window(
        self, window_id: str, samples, options: DecodeOptions, priority, encoder_frames=None
    ) -> DecodeResult:
        self.calls.append((window_id, options))
        self.encoder_frames[window_id] = encoder_frames
        await asyncio.sleep(0.01)
        return DecodeResult(
            request_id=window_id,
            tokens=[1, 2],
            text=" Hello there.",
            avg_logprob=-0.375,
            no_speech_prob=0.0,
            language="en",
            temperature=0.0,
            finish_reason=FinishReason.STOP,
            token_logprobs=TEXT_TOKENS if options.token_logprobs else None,
        )


def session_app(
    options: RealtimeOptions,
    metrics: ServingMetrics,
    pipeline: RecordingPipeline | None = None,
    partial_slots: int = 4,
    model_realtime: RealtimeOptions | None = None,
) -> FastAPI:
    """An app of one ingress replica's sessions. They share its partial slots, so several sessions
    must run on one event loop: open them on a TestClient used as a context manager.
    ``model_realtime``: the served model's realtime options, as chosen for its device."""
    app = FastAPI()
    partial_passes = PartialSchedule(partial_slots)

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await websocket.accept()
        # Without a pipeline a session never reaches a pass (a pass would fail loudly on None).
        model = ServedModel(
            "tiny.en",
            ("tiny.en", "whisper-1"),
            pipeline,
            AcceptedOptions(english_only),
            realtime=model_realtime,
        )
        session = RealtimeSession(
            websocket,
            options,
            ServedModels([model], "tiny.en"),
            metrics,
            partial_passes,
            ANONYMOUS,
            LiveSpeakers(None),  # an app without a diarizer
        )
        await session.run()

    return app


def _update(
    websocket, turn_detection: dict | None, include: list[str] | None = None, **transcription
) -> dict:
    session = {
        "type": "transcription",
        "audio": {"input": {"transcription": transcription, "turn_detection": turn_detection}},
    }
    if include is not None:
        session["include"] = include
    websocket.send_json({"type": "session.update", "session": session})
    return websocket.receive_json()


def _append_silence(websocket, seconds: float) -> None:
    websocket.send_json(
        {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(bytes(round(seconds * RATE_HZ) * 2)).decode(),
        }
    )


def _events_until(websocket, last_type: str, count: int = 1) -> list[dict]:
    events = []
    while count:
        events.append(websocket.receive_json())
        count -= events[-1]["type"] == last_type
    return events


def _audio_seconds(metrics: ServingMetrics, model: str) -> float:
    labels = {"model": model, "api_key": ANONYMOUS}
    return metrics.registry.get_sample_value("whisper_audio_seconds_total", labels) or 0.0


def _wait_for(condition, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_a_session_with_no_client_event_for_the_idle_timeout_gets_an_error_event_and_a_normal_close():
    metrics = ServingMetrics()
    app = session_app(RealtimeOptions(idle_timeout_s=IDLE_TIMEOUT_S), metrics)
    with TestClient(app).websocket_connect("/v1/realtime") as websocket:
        assert websocket.receive_json()["type"] == "session.created"
        websocket.send_json({"type": "input_audio_buffer.clear"})  # an event: the idle clock restarts
        assert websocket.receive_json()["type"] == "input_audio_buffer.cleared"
        quiet_from = time.monotonic()
        error = websocket.receive_json()
        waited_s = time.monotonic() - quiet_from
        assert error["type"] == "error" and error["error"]["code"] == "idle_timeout"
        assert IDLE_TIMEOUT_S * 0.9 <= waited_s < IDLE_TIMEOUT_S + 5
        with pytest.raises(WebSocketDisconnect) as closed:
            websocket.receive_json()
        assert closed.value.code == CLOSE_NORMAL


def test_session_events_name_the_model_the_session_uses_and_echo_include_and_idle_timeout():
    with TestClient(session_app(RealtimeOptions(), ServingMetrics())).websocket_connect("/v1/realtime") as ws:
        created = ws.receive_json()
        assert created["session"]["audio"]["input"]["transcription"]["model"] == "tiny.en", "the default"
        assert created["session"]["include"] is None
        vad = {"type": "server_vad", "idle_timeout_ms": 1500}
        updated = _update(ws, vad, include=["item.input_audio_transcription.logprobs"], model="whisper-1")
        assert updated["session"]["audio"]["input"]["transcription"]["model"] == "whisper-1", "as chosen"
        assert updated["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 1500
        assert updated["session"]["include"] == ["item.input_audio_transcription.logprobs"]
        ws.send_json(
            {"type": "session.update", "session": {"type": "transcription", "include": ["item.bogus"]}}
        )
        refused = ws.receive_json()
        assert refused["type"] == "error" and refused["error"]["param"] == "session.include.0"


def test_language_and_prompt_reach_every_pass_partial_and_final_of_a_turn_opened_after_the_update():
    pipeline, metrics = RecordingPipeline(), ServingMetrics()
    app = session_app(RealtimeOptions(partial_interval_ms=50), metrics, pipeline)
    with TestClient(app).websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        assert _update(ws, None, language="en", prompt="Hello, Ada.")["type"] == "session.updated"
        _append_silence(ws, 2.0)  # past the 1.5 s a turn needs before its partial passes
        _wait_for(lambda: any("-p" in window_id for window_id, _ in pipeline.calls))
        ws.send_json({"type": "input_audio_buffer.commit"})
        _events_until(ws, COMPLETED)
    kinds = {window_id.rsplit("-", 2)[1][0] for window_id, _ in pipeline.calls}
    assert kinds == {"p", "f"}, pipeline.calls
    for _, options in pipeline.calls:
        assert (options.language, options.prompt) == ("en", "Hello, Ada.")


def _encoder_frames_of_a_turn(app, pipeline: RecordingPipeline) -> tuple[list, list]:
    """One turn of 2 s of audio, committed once a partial pass has gone out: the encoder frames of
    its partial passes and of its final pass (None: a full 30 s window)."""
    with TestClient(app).websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        _update(ws, None)
        _append_silence(ws, 2.0)
        _wait_for(lambda: any("-p" in window_id for window_id in pipeline.encoder_frames))
        ws.send_json({"type": "input_audio_buffer.commit"})
        _events_until(ws, COMPLETED)
    partial = [frames for window_id, frames in pipeline.encoder_frames.items() if "-p" in window_id]
    final = [frames for window_id, frames in pipeline.encoder_frames.items() if "-f" in window_id]
    return partial, final


@pytest.mark.parametrize(
    "partial_context, step_s, partial_frames",
    [
        # At most 2 s of audio and 1 s of silence: in whole seconds of 50 encoder frames, or one 10 s step.
        ("audio", 1, {100, 150}),
        ("audio", 10, {500}),
        ("full_window", 1, {None}),
    ],
)
def test_partial_passes_are_encoded_over_the_audio_they_have_and_the_final_pass_over_the_full_window(
    partial_context, step_s, partial_frames
):
    pipeline, metrics = RecordingPipeline(), ServingMetrics()
    options = RealtimeOptions(
        partial_interval_ms=50,
        partial_context=partial_context,
        partial_context_pad_s=1.0,
        partial_context_min_s=0.0,
        partial_context_step_s=step_s,
    )
    partial, final = _encoder_frames_of_a_turn(session_app(options, metrics, pipeline), pipeline)
    assert final == [None], "the final pass: a full 30 s window"
    assert partial and set(partial) <= partial_frames, partial


def test_a_model_on_a_cpu_encodes_its_live_turns_partial_passes_over_their_audio_in_whole_seconds():
    """The session's options leave the context to the device; the model's, chosen for a CPU, take
    the audio's context in one-second steps (at least 5 s by default), and the final pass the full
    window."""
    pipeline, metrics = RecordingPipeline(), ServingMetrics()
    options = RealtimeOptions(partial_interval_ms=50)
    app = session_app(options, metrics, pipeline, model_realtime=options.on("cpu"))
    partial, final = _encoder_frames_of_a_turn(app, pipeline)
    assert final == [None], "the final pass: a full 30 s window"
    assert partial and set(partial) == {250}, "2 s of audio and 1 s of silence: at least 5 s, 250 frames"


def test_a_language_the_model_does_not_know_is_an_error_naming_its_param_and_the_session_goes_on():
    with TestClient(session_app(RealtimeOptions(), ServingMetrics())).websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        refused = _update(ws, None, language="de")
        assert refused["type"] == "error" and refused["error"]["code"] == "invalid_value"
        assert refused["error"]["param"] == "session.audio.input.transcription.language"
        assert "de" in refused["error"]["message"]
        updated = _update(ws, None, language="en")
        assert updated["session"]["audio"]["input"]["transcription"]["language"] == "en"


def test_diarize_on_an_app_without_a_diarizer_is_an_error_naming_the_field_and_the_session_goes_on():
    app = session_app(RealtimeOptions(), ServingMetrics(), RecordingPipeline())
    with TestClient(app).websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        refused = _update(ws, None, diarize=True)
        assert refused["type"] == "error" and refused["error"]["code"] == "diarization_unavailable"
        assert refused["error"]["param"] == "session.audio.input.transcription.diarize"
        updated = _update(ws, None, diarize=False, language="en")
        transcription = updated["session"]["audio"]["input"]["transcription"]
        assert (transcription["diarize"], transcription["language"]) == (False, "en")
        _append_silence(ws, 0.5)
        ws.send_json({"type": "input_audio_buffer.commit"})
        completed = _events_until(ws, COMPLETED)[-1]
        assert "speaker" not in completed, "speakers only when the session asks for them"


def test_a_completed_turn_has_its_final_tokens_logprobs_when_included_its_usage_and_bills_its_seconds():
    pipeline, metrics = RecordingPipeline(), ServingMetrics()
    with TestClient(session_app(RealtimeOptions(), metrics, pipeline)).websocket_connect(
        "/v1/realtime"
    ) as ws:
        ws.receive_json()
        for include, seconds in ((["item.input_audio_transcription.logprobs"], 1.25), ([], 0.5)):
            _update(ws, None, include=include)
            _append_silence(ws, seconds)
            ws.send_json({"type": "input_audio_buffer.commit"})
            completed = _events_until(ws, COMPLETED)[-1]
            assert completed["transcript"] == "Hello there."
            assert completed["usage"] == {"type": "duration", "seconds": seconds}
            if include:
                assert completed["logprobs"] == [
                    {"token": " Hello", "logprob": -0.25, "bytes": list(b" Hello")},
                    {"token": " there.", "logprob": -0.5, "bytes": list(b" there.")},
                ]
            else:
                assert "logprobs" not in completed
    assert _audio_seconds(metrics, "tiny.en") == 1.75, "each turn's seconds, to the served model's name"
    assert [options.token_logprobs for _, options in pipeline.calls] == [True, False]


def test_quiet_past_the_idle_timeout_is_committed_as_a_turn_after_timeout_triggered_once_per_stretch():
    pipeline, metrics = RecordingPipeline(), ServingMetrics()
    with TestClient(session_app(RealtimeOptions(), metrics, pipeline)).websocket_connect(
        "/v1/realtime"
    ) as ws:
        ws.receive_json()
        _update(ws, {"type": "server_vad", "idle_timeout_ms": 1000})
        _append_silence(ws, 2.5)  # at once: the quiet is counted in audio time
        events = _events_until(ws, COMPLETED, count=2)
    timeouts = [e for e in events if e["type"] == "input_audio_buffer.timeout_triggered"]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"] == COMPLETED]
    assert len(timeouts) == len(committed) == len(completed) == 2, [e["type"] for e in events]
    assert timeouts[0]["audio_start_ms"] == 0 and timeouts[1]["audio_start_ms"] == timeouts[0]["audio_end_ms"]
    for timeout, commit, done in zip(timeouts, committed, completed):
        assert timeout["item_id"] == commit["item_id"] == done["item_id"]
        assert 1000 <= timeout["audio_end_ms"] - timeout["audio_start_ms"] <= 1032
        assert done["usage"]["seconds"] == (timeout["audio_end_ms"] - timeout["audio_start_ms"]) / 1000
    assert events.index(timeouts[0]) < events.index(committed[0]), "timeout_triggered, then committed"
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]


class SlowPipeline(RecordingPipeline):
    """Every pass takes a while: long enough for its client to go away meanwhile."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s
        self.answered = 0

    async def decode_window(self, *args, **kwargs) -> DecodeResult:
        await asyncio.sleep(self.delay_s)
        result = await super().decode_window(*args, **kwargs)
        self.answered += 1
        return result


class SentAfterDisconnect:
    """ASGI middleware that keeps (and does not pass on) what the app sends once it has received
    the client's disconnect: Serve's proxy fails on such a message, its socket being closed."""

    def __init__(self, app):
        self.app = app
        self.late: list[dict] = []

    async def __call__(self, scope, receive, send):
        disconnected = False

        async def receive_noting_disconnect():
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "websocket.disconnect"
            return message

        async def send_before_disconnect(message):
            if disconnected:
                self.late.append(message)
            else:
                await send(message)

        await self.app(scope, receive_noting_disconnect, send_before_disconnect)


def test_a_pass_that_ends_after_its_client_has_gone_sends_it_nothing():
    pipeline = SlowPipeline(delay_s=0.3)
    app = SentAfterDisconnect(session_app(RealtimeOptions(), ServingMetrics(), pipeline))
    with TestClient(app).websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        _update(ws, None)
        _append_silence(ws, 1.0)
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert ws.receive_json()["type"] == "input_audio_buffer.committed"
        ws.close()  # the client hangs up with the turn's final pass under way
        _wait_for(lambda: pipeline.answered)  # the pass runs to its end
        time.sleep(0.2)  # and whatever follows its answer has run
    assert app.late == []
