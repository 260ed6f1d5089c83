"""When live turns get partial passes: many sessions of one replica sharing its partial slots,
and a pause inside a turn, over real WebSockets (Starlette's test transport) without Ray, with a
pipeline that stands in for the encoders and decoders."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from deployments.config import RealtimeOptions
from deployments.metrics import ServingMetrics
from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.types import DecodeResult, FinishReason
from tests.deployments.http.test_realtime_session import COMPLETED, RATE_HZ, RecordingPipeline, session_app
from tests.support.live_stream import to_pcm16_24k
from tests.support.speech import SPEECH_DIR

CHUNK_S = 0.1
DELTA = "conversation.item.input_audio_transcription.delta"


class TimedPipeline(RecordingPipeline):
    """Every partial pass takes ``partial_s`` and reads one word per quarter second of the audio it
    heard (so that passes over more audio agree on more words); it notes the most partial passes
    out at once and each one's audio."""

    def __init__(self, partial_s: float):
        super().__init__()
        self.partial_s = partial_s
        self.partials_out = self.most_partials_out = 0
        self.partial_audio_s: dict[str, list[float]] = {}  # item id -> each partial pass's audio
        self._lock = threading.Lock()

    async def decode_window(self, window_id, samples, options, priority, encoder_frames=None):
        item_id, kind = window_id.rsplit("-", 1)
        heard_s = len(samples) / SAMPLE_RATE
        words = " ".join(f"w{index}" for index in range(int(heard_s * 4)))
        if kind.startswith("p"):
            with self._lock:
                self.partial_audio_s.setdefault(item_id, []).append(heard_s)
                self.partials_out += 1
                self.most_partials_out = max(self.most_partials_out, self.partials_out)
            await asyncio.sleep(self.partial_s)
            with self._lock:
                self.partials_out -= 1
        return DecodeResult(
            request_id=window_id,
            tokens=[1],
            text=words,
            avg_logprob=-0.1,
            no_speech_prob=0.0,
            language="en",
            temperature=0.0,
            finish_reason=FinishReason.STOP,
        )


def _append(websocket, pcm16: bytes) -> None:
    websocket.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})


def _stream_live(websocket, pcm16: bytes, started_s: float, sent_s: float = 0.0) -> float:
    """Send ``pcm16`` in chunks at real-time pace, the stream having sent ``sent_s`` seconds of audio
    since ``started_s``; returns the seconds sent once it is all out."""
    chunk = round(CHUNK_S * RATE_HZ) * 2
    for offset in range(0, len(pcm16), chunk):
        time.sleep(max(0.0, started_s + sent_s - time.monotonic()))
        _append(websocket, pcm16[offset : offset + chunk])
        sent_s += len(pcm16[offset : offset + chunk]) / 2 / RATE_HZ
    return sent_s


def _manual_turns(websocket, turns: int, turn_s: float) -> list[dict]:
    """One client: ``turns`` turns of ``turn_s`` each, committed as each ends; every event until
    the last turn completes."""
    websocket.receive_json()
    websocket.send_json(
        {
            "type": "session.update",
            "session": {"type": "transcription", "audio": {"input": {"turn_detection": None}}},
        }
    )
    websocket.receive_json()
    started_s, sent_s = time.monotonic(), 0.0
    for _ in range(turns):
        sent_s = _stream_live(websocket, bytes(round(turn_s * RATE_HZ) * 2), started_s, sent_s)
        websocket.send_json({"type": "input_audio_buffer.commit"})
    events = []
    while sum(event["type"] == COMPLETED for event in events) < turns:
        events.append(websocket.receive_json())
    return events


@pytest.mark.slow
def test_beyond_the_replicas_partial_capacity_every_final_arrives_and_every_stream_gets_thinned_partials():
    """Six streams want a pass every 100 ms, 60 a second, where one slot and 50 ms passes allow at
    most 20: every turn completes, and every turn of every stream gets partial passes, each stream
    a fair share of them, rather than some streams taking the slot each time it frees and others
    none."""
    streams, turns, turn_s = 6, 2, 5.0
    pipeline = TimedPipeline(partial_s=0.05)
    options = RealtimeOptions(partial_interval_ms=100, partial_agreement_s=0, max_partial_passes_in_flight=1)
    with TestClient(session_app(options, ServingMetrics(), pipeline, partial_slots=1)) as client:
        with contextlib.ExitStack() as connections:
            sockets = [
                connections.enter_context(client.websocket_connect("/v1/realtime")) for _ in range(streams)
            ]
            with ThreadPoolExecutor(streams) as pool:
                records = list(pool.map(lambda websocket: _manual_turns(websocket, turns, turn_s), sockets))

    assert pipeline.most_partials_out == 1, "never more partial passes out than the replica's slots"
    passes = []  # per stream, per turn
    for events in records:
        completed = [event for event in events if event["type"] == COMPLETED]
        assert len(completed) == turns, "every turn's final text arrives"
        passes.append([len(pipeline.partial_audio_s.get(turn["item_id"], [])) for turn in completed])
        # A turn's deltas before its commit come from its partial passes (the final pass's after).
        committed = {
            event["item_id"]: index
            for index, event in enumerate(events)
            if event["type"].endswith("committed")
        }
        partial_deltas = [
            (event["item_id"], event["delta"])
            for index, event in enumerate(events)
            if event["type"] == DELTA and index < committed[event["item_id"]]
        ]
        assert partial_deltas, f"partial text for every stream: {passes}"
        for turn in completed:
            partial_text = "".join(delta for item_id, delta in partial_deltas if item_id == turn["item_id"])
            assert turn["transcript"].startswith(partial_text.strip())
    assert all(all(per_turn) for per_turn in passes), (
        f"partial passes in every turn of every stream: {passes}"
    )
    per_stream = [sum(per_turn) for per_turn in passes]
    # Each turn wants passes for 2 s (from 1.5 s of audio to its commit): 20 at full cadence.
    assert max(per_stream) < turns * 20, "thinned out: fewer than the full cadence"
    assert min(per_stream) >= sum(per_stream) / streams / 2, f"each stream at least half its share: {passes}"


# jfk.flac as Silero hears it: speech from 0.35 s to 2.24 s ("And so my fellow Americans,"), a
# pause, and speech again from 3.35 s ("ask not...") to 4.4 s.
JFK_PAUSE_S = (2.24, 3.35)


@pytest.mark.slow
def test_a_pause_inside_a_turn_gets_no_partial_pass_until_speech_resumes_and_counts_as_unchanged():
    pipeline, metrics = TimedPipeline(partial_s=0.01), ServingMetrics()
    lead_s = 0.5
    speech = to_pcm16_24k(load_audio_file(SPEECH_DIR / "jfk.flac")[: round(4.3 * SAMPLE_RATE)])
    app = session_app(RealtimeOptions(partial_interval_ms=100), metrics, pipeline)
    with TestClient(app).websocket_connect("/v1/realtime") as websocket:
        websocket.receive_json()
        vad = {"type": "server_vad", "silence_duration_ms": 1500}  # the pause stays inside the turn
        websocket.send_json(
            {
                "type": "session.update",
                "session": {"type": "transcription", "audio": {"input": {"turn_detection": vad}}},
            }
        )
        websocket.receive_json()
        started_s = time.monotonic()
        sent_s = _stream_live(websocket, bytes(round(lead_s * RATE_HZ) * 2), started_s)
        sent_s = _stream_live(websocket, speech, started_s, sent_s)
        _stream_live(websocket, bytes(round(1.8 * RATE_HZ) * 2), started_s, sent_s)
        events = []
        while not events or events[-1]["type"] != COMPLETED:
            events.append(websocket.receive_json())
    types = Counter(event["type"] for event in events)
    assert types["input_audio_buffer.speech_started"] == types[COMPLETED] == 1, "one turn, pause and all"
    started = next(event for event in events if event["type"] == "input_audio_buffer.speech_started")
    pause_from_s, pause_to_s = (lead_s + at_s - started["audio_start_ms"] / 1000 for at_s in JFK_PAUSE_S)
    [heard_s] = pipeline.partial_audio_s.values()  # each partial pass's audio, in turn seconds
    # The VAD hears the pause a frame or two after it begins: a pass may hear that much of it.
    in_pause = [
        (before, after)
        for before, after in zip(heard_s, heard_s[1:])
        if before >= pause_from_s + 0.2 and after <= pause_to_s
    ]
    assert not in_pause, (
        f"passes over nothing new but the pause {pause_from_s:.2f}-{pause_to_s:.2f} s: {heard_s}"
    )
    assert any(after > pause_to_s for after in heard_s), "partial passes resume with the speech"
    assert metrics.registry.get_sample_value("whisper_realtime_partial_passes_unchanged_total") >= 3
