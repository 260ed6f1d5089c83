"""A live caller for the realtime endpoint, shared by tests/deployments/test_realtime.py and
benchmarks/bench_realtime.py: utterances streamed as pcm16 at 24 kHz (OpenAI's realtime format) in
fixed-size chunks at real-time pace, with silence between them, over the official `openai`
client's realtime connection; every server event recorded with the time it arrived.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from engine.model.audio import SAMPLE_RATE, resample

REALTIME_RATE_HZ = 24000


def to_pcm16_24k(samples_16k: np.ndarray) -> bytes:
    """16 kHz float samples (the speech set as loaded) -> the bytes a realtime client sends."""
    samples = resample(samples_16k, SAMPLE_RATE, REALTIME_RATE_HZ)
    return (np.clip(samples, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


@dataclass
class LiveStreamRecord:
    events: list[tuple[float, dict]] = field(default_factory=list)  # (time.perf_counter(), event)
    speech_ends_s: list[float] = field(default_factory=list)  # when each utterance's last chunk went out
    speech_audio_ends_s: list[float] = field(default_factory=list)  # stream time of each utterance's end
    stream_started_s: float = 0.0

    def of_type(self, event_type: str) -> list[dict]:
        return [event for _, event in self.events if event["type"] == event_type]

    def turns(self) -> list[dict]:
        """Per completed turn, in order: its item id, completed text, deltas and their times."""
        completed = [
            (at, event) for at, event in self.events if event["type"].endswith("transcription.completed")
        ]
        turns = []
        for at, event in completed:
            deltas = [
                (t, e["delta"])
                for t, e in self.events
                if e["type"].endswith("transcription.delta") and e["item_id"] == event["item_id"]
            ]
            turns.append(
                {"item_id": event["item_id"], "text": event["transcript"], "at": at, "deltas": deltas}
            )
        return turns


def stream_live(
    connection,
    utterances: list[bytes],
    silence_s: float = 1.0,
    chunk_ms: int = 40,
    commit: bool = False,
    lead_silence_s: float = 0.5,
    timeout_s: float = 120.0,
    stop_after_bytes: int | None = None,
    pace: float = 1.0,
) -> LiveStreamRecord:
    """Stream pcm16 24 kHz utterances at real-time pace (or ``pace``) and record the events until every
    utterance has its completed (or failed) event. ``commit``: manual turns (the client commits
    each utterance as its audio ends) instead of the server's VAD. ``stop_after_bytes``: stop
    sending after this much audio and return without waiting (a client that hangs up mid-turn).
    ``pace``: seconds of audio sent per second (below 1: a client whose audio comes slower than
    real time, as over a congested link)."""
    record = LiveStreamRecord()
    chunk_bytes = REALTIME_RATE_HZ * 2 * chunk_ms // 1000
    silence = bytes(int(REALTIME_RATE_HZ * silence_s) * 2)
    done_sending = threading.Event()

    def send() -> None:
        sent = 0
        record.stream_started_s = time.perf_counter()
        audio_s = 0.0

        def paced(audio: bytes) -> bool:
            nonlocal sent, audio_s
            for offset in range(0, len(audio), chunk_bytes):
                if stop_after_bytes is not None and sent >= stop_after_bytes:
                    return False
                chunk = audio[offset : offset + chunk_bytes]
                delay_s = record.stream_started_s + audio_s / pace - time.perf_counter()
                if delay_s > 0:
                    time.sleep(delay_s)
                connection.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
                sent += len(chunk)
                audio_s += len(chunk) / (2 * REALTIME_RATE_HZ)
            return True

        try:
            if not paced(bytes(int(REALTIME_RATE_HZ * lead_silence_s) * 2)):
                return
            for utterance in utterances:
                if not paced(utterance):
                    return
                record.speech_ends_s.append(time.perf_counter())
                record.speech_audio_ends_s.append(audio_s)
                if commit:
                    connection.input_audio_buffer.commit()
                if not paced(silence):
                    return
        finally:
            done_sending.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    if stop_after_bytes is not None:
        sender.join(timeout_s)
        return record
    deadline = time.perf_counter() + timeout_s
    finished = 0
    while finished < len(utterances):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{finished} of {len(utterances)} turns finished in {timeout_s} s")
        event = json.loads(connection.recv_bytes())
        record.events.append((time.perf_counter(), event))
        if event["type"].endswith("transcription.completed") or event["type"].endswith(
            "transcription.failed"
        ):
            finished += 1
    sender.join(timeout_s)
    return record


def transcription_session(turn_detection: dict | None, **audio_input) -> dict:
    """A GA `session.update`'s session for a transcription session with pcm16 at 24 kHz."""
    return {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": REALTIME_RATE_HZ},
                "transcription": {"model": "whisper-1"},
                "turn_detection": turn_detection,
                **audio_input,
            }
        },
    }
