"""The traffic benchmarks/bench_goodput.py sends: the audio of each kind of arrival (files cut to a
drawn length from a tape of the speech set, live streams of whole utterances), how one arrival is
sent to the app, and how an open-loop schedule is played: every arrival on its own thread at its
time, however many earlier ones are still waiting.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from engine.model.audio import SAMPLE_RATE, load_audio_file
from tests.support.live_stream import REALTIME_RATE_HZ, stream_live, to_pcm16_24k, transcription_session
from tests.support.mixed_load import Arrival, Outcome
from tests.support.speech import english_clips, speech_tape, wav_bytes

# The kinds of the mix, and the priority each file kind is sent with.
LIVE, SHORT, LONG = "live", "short", "long"
FILE_PRIORITY = {SHORT: "interactive", LONG: "batch"}
# Utterances tiny.en transcribes well, as benchmarks/bench_realtime.py streams them.
LIVE_CLIP_IDS = [
    "tts_01",
    "osr72_04",
    "tts_11",
    "tts_14",
    "osr72_02",
    "tts_20",
    "tts_24",
    "tts_28",
    "osr72_08",
]
LIVE_SILENCE_S = 1.0
LIVE_CHUNK_MS = 40


@dataclass(frozen=True)
class Lengths:
    """The audio of each kind: file lengths drawn uniformly from a range, and a live stream's
    utterances (each committed by the client as its audio ends, so the end of speech is known)."""

    short_s: tuple[float, float]
    long_s: tuple[float, float]
    live_turns: int


class MixAudio:
    """What every arrival sends, decided by its seed alone."""

    def __init__(self, lengths: Lengths):
        self.lengths = lengths
        # Offsets into the tape vary the files' words; its length covers the longest file.
        self.tape = speech_tape(max(lengths.long_s[1], lengths.short_s[1]) + 60)
        clips = {clip.id: clip for clip in english_clips()}
        self.utterances = [to_pcm16_24k(load_audio_file(clips[clip_id].path)) for clip_id in LIVE_CLIP_IDS]

    def file_samples(self, arrival: Arrival) -> np.ndarray:
        low_s, high_s = self.lengths.short_s if arrival.kind == SHORT else self.lengths.long_s
        draw = random.Random(arrival.seed)
        length = int(draw.uniform(low_s, high_s) * SAMPLE_RATE)
        start = draw.randrange(0, len(self.tape) - length)
        return self.tape[start : start + length]

    def live_utterances(self, arrival: Arrival) -> list[bytes]:
        draw = random.Random(arrival.seed)
        return [draw.choice(self.utterances) for _ in range(self.lengths.live_turns)]

    def live_audio_s(self, utterances: list[bytes]) -> float:
        return sum(len(u) / (2 * REALTIME_RATE_HZ) + LIVE_SILENCE_S for u in utterances)


@dataclass(frozen=True)
class AppClient:
    """Where and how to send: the app's URL, its API key (None: none configured) and the vendor
    form fields every file request carries (e.g. fixed_output_tokens)."""

    url: str
    api_key: str | None
    fields: dict[str, str]
    request_timeout_s: float

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def send_file(self, kind: str, samples: np.ndarray) -> Outcome:
        audio_s = len(samples) / SAMPLE_RATE
        outcome = Outcome(kind, audio_s, expected=1)
        form = {"model": "whisper-1", "priority": FILE_PRIORITY[kind], **self.fields}
        upload = wav_bytes(samples)
        started = time.perf_counter()
        try:
            response = httpx.post(
                f"{self.url}/v1/audio/transcriptions",
                headers=self.headers,
                files={"file": ("audio.wav", upload)},
                data=form,
                timeout=self.request_timeout_s,
            )
        except httpx.HTTPError as error:
            outcome.status = type(error).__name__
            return outcome
        if response.status_code == 200:
            outcome.latencies_s.append(time.perf_counter() - started)
        else:
            outcome.status = str(response.status_code)
        return outcome

    def send_live(self, utterances: list[bytes], audio_s: float) -> Outcome:
        import openai

        outcome = Outcome(LIVE, audio_s, expected=len(utterances))
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=60
        )
        try:
            with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
                connection.recv_bytes()  # session.created
                connection.session.update(session=transcription_session(None))
                connection.recv_bytes()  # session.updated
                record = stream_live(
                    connection,
                    utterances,
                    silence_s=LIVE_SILENCE_S,
                    chunk_ms=LIVE_CHUNK_MS,
                    commit=True,
                    timeout_s=audio_s + self.request_timeout_s,
                )
        except Exception as error:  # a refused or dropped session is an outcome, not a crash
            outcome.status = type(error).__name__
            return outcome
        # Turns by the item each commit made, so a failed turn does not shift the others' times.
        committed = [event["item_id"] for event in record.of_type("input_audio_buffer.committed")]
        speech_ends_s = dict(zip(committed, record.speech_ends_s))
        for turn in record.turns():
            if turn["item_id"] in speech_ends_s:
                outcome.latencies_s.append(turn["at"] - speech_ends_s[turn["item_id"]])
        if record.of_type("conversation.item.input_audio_transcription.failed"):
            outcome.status = "turn failed"
        return outcome


def send_to_app(app: AppClient, audio: MixAudio) -> Callable[[Arrival], Outcome]:
    def send(arrival: Arrival) -> Outcome:
        if arrival.kind == LIVE:
            utterances = audio.live_utterances(arrival)
            return app.send_live(utterances, audio.live_audio_s(utterances))
        return app.send_file(arrival.kind, audio.file_samples(arrival))

    return send


def play(arrivals: list[Arrival], send: Callable[[Arrival], Outcome]) -> list[Outcome]:
    """Send every arrival at its time on a thread of its own and wait for all their outcomes."""
    outcomes: list[Outcome | None] = [None] * len(arrivals)

    def one(index: int) -> None:
        arrival = arrivals[index]
        try:
            outcomes[index] = send(arrival)
        except Exception as error:  # the sender's own failure still counts the arrival as sent
            outcomes[index] = Outcome(arrival.kind, 0.0, expected=1, status=type(error).__name__)

    started = time.perf_counter()
    threads = []
    for index, arrival in enumerate(arrivals):
        delay_s = started + arrival.at_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)
        threads.append(threading.Thread(target=one, args=(index,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return [outcome for outcome in outcomes if outcome is not None]
