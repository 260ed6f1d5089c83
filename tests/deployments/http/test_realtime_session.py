"""A realtime session's own rules, over a real WebSocket (Starlette's test transport) without Ray:
what needs no decoding. The whole app over the official client is tests/deployments/test_realtime.py."""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.config import RealtimeOptions
from deployments.http.option_checks import AcceptedOptions
from deployments.http.realtime import CLOSE_NORMAL, RealtimeSession
from deployments.metrics import ServingMetrics
from deployments.orchestration.live_turn import PartialPassSlots
from deployments.served_models import ServedModel, ServedModels

IDLE_TIMEOUT_S = 0.5


async def accept_everything(options) -> None:
    return None


def session_app(options: RealtimeOptions, metrics: ServingMetrics) -> FastAPI:
    app = FastAPI()

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await websocket.accept()
        # No pipeline: these sessions never reach a pass (a pass would fail loudly on None).
        model = ServedModel("whisper-1", ("whisper-1",), None, AcceptedOptions(accept_everything))
        session = RealtimeSession(
            websocket, options, ServedModels([model], "whisper-1"), metrics, PartialPassSlots(1)
        )
        await session.run()

    return app


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
