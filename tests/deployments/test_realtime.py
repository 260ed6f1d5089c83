"""Live transcription over `GET /v1/realtime?intent=transcription` on the default app
(configs/default.yaml) on a real local Ray and Serve, spoken to by the official `openai` client's
realtime connection: speech-set clips streamed at real-time pace as pcm16 24 kHz in 20-100 ms chunks,
with silence between utterances, turns found by the server's Silero VAD or committed by the client.
"""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
import websockets.sync.client

from deployments.http.formats import duration_usage
from deployments.metrics import api_key_label
from engine.model.audio import load_audio_file
from engine.transcribe.evaluation import normalize_english, word_error_rate
from tests.support import ray_logs
from tests.support.app_metrics import labelled_sum, metric_sum
from tests.support.live_stream import REALTIME_RATE_HZ, stream_live, to_pcm16_24k, transcription_session
from tests.support.serving import (
    KEYED_MAX_SESSIONS,
    REALTIME_API_KEY,
    keyed_app_args,
    replica_actor,
    running_app,
)
from tests.support.speech import SPEECH_DIR, english_clips

pytestmark = pytest.mark.ray

API_KEY = REALTIME_API_KEY
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SESSIONS = KEYED_MAX_SESSIONS
SERVER_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
# Utterances of 2.9 to 4.5 s without pauses inside (a pause longer than silence_duration_ms ends a
# turn, as it should), a recorded speaker and synthetic voices, that tiny.en transcribes without an
# error from the file: so live and file texts can be compared word for word.
CLIP_IDS = ["tts_01", "osr72_04", "tts_11", "tts_28"]
ONE_NEAR_TIE = 2  # word edits (see _words_apart)
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(scope="module")
def server_url():
    # tests/deployments/test_hostile_input.py's app, which runs just before and leaves it running.
    with running_app(keyed_app_args(), shared=True) as url:
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/ready", timeout=30).status_code != 200:  # warm: first passes not slow
            assert time.monotonic() < deadline, "the app never got ready"
            time.sleep(0.5)
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _connect(client: openai.OpenAI):
    return client.realtime.connect(extra_query={"intent": "transcription"})


def _recv(connection) -> dict:
    return json.loads(connection.recv_bytes())


def _open(client: openai.OpenAI, turn_detection: dict | None):
    connection = _connect(client).enter()
    assert _recv(connection)["type"] == "session.created"
    connection.session.update(session=transcription_session(turn_detection))
    updated = _recv(connection)
    assert updated["type"] == "session.updated", updated
    assert updated["session"]["audio"]["input"]["turn_detection"] == (
        {"idle_timeout_ms": None, **turn_detection} if turn_detection else None
    )
    return connection


def _utterances(clip_ids: list[str]) -> list[bytes]:
    clips = {clip.id: clip for clip in english_clips()}
    return [to_pcm16_24k(load_audio_file(clips[clip_id].path)) for clip_id in clip_ids]


def _file_text(client: openai.OpenAI, pcm16: bytes) -> str:
    """The file endpoint's text for exactly the audio a stream sent, all of it decoded as a turn's
    final pass decodes it: without speech detection (chunking_strategy=none; the shipped config
    would otherwise pack windows from the speech it finds)."""
    wav = io.BytesIO()
    soundfile.write(wav, np.frombuffer(pcm16, dtype="<i2"), REALTIME_RATE_HZ, format="WAV", subtype="PCM_16")
    return client.audio.transcriptions.create(
        model="whisper-1", file=("clip.wav", wav.getvalue()), chunking_strategy="none"
    ).text


def _words_apart(live_text: str, file_text: str) -> int:
    """Word edits between a live turn's text and the file endpoint's for the same audio. They may
    differ where tiny.en is near a tie: the turn holds the silence before it too, and its partial
    passes, over audio cut mid-turn at points that depend on the machine's speed, commit words that
    the final pass cannot take back (deltas never retract). One tie costs up to two edits: in jfk
    "ask" or "asked", and "my" or "am I" (a substitution and an insertion)."""
    import jiwer

    reference = normalize_english(file_text)
    return round(jiwer.wer(reference, normalize_english(live_text)) * len(reference.split()))


def metric_sum_plain(server_url: str, name: str) -> float:
    """A metric without labels, as this ingress replica reports it."""
    lines = httpx.get(f"{server_url}/metrics", headers=AUTH, timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " "))


def _assert_everything_is_free(server_url: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        used = metric_sum(server_url, "whisper_decoder_kv_blocks_used", AUTH)
        staged = metric_sum(server_url, "whisper_encoder_staged", AUTH)
        if used == 0 and staged == 0:
            break
        assert time.monotonic() < deadline, f"{used} KV blocks still used, {staged} windows still staged"
        time.sleep(0.25)
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_free", AUTH) > 0, "the decoder reported its pool"


def test_server_vad_turns_have_started_deltas_stopped_and_the_file_endpoints_text(client, server_url):
    utterances = _utterances(CLIP_IDS)
    connection = _open(client, SERVER_VAD)
    try:
        record = stream_live(connection, utterances, silence_s=1.2, chunk_ms=40)
    finally:
        connection.close()
    started = record.of_type("input_audio_buffer.speech_started")
    stopped = record.of_type("input_audio_buffer.speech_stopped")
    committed = record.of_type("input_audio_buffer.committed")
    turns = record.turns()
    assert len(started) == len(stopped) == len(committed) == len(turns) == len(CLIP_IDS), [
        e["type"] for _, e in record.events
    ]
    for index, turn in enumerate(turns):
        assert started[index]["item_id"] == stopped[index]["item_id"] == turn["item_id"]
        assert committed[index]["previous_item_id"] == (turns[index - 1]["item_id"] if index else None)
        # Turn times are on the stream's clock: after the lead silence, around each utterance.
        assert started[index]["audio_start_ms"] < stopped[index]["audio_end_ms"]
        assert abs(stopped[index]["audio_end_ms"] / 1000 - record.speech_audio_ends_s[index]) < 0.6
        assert "".join(delta for _, delta in turn["deltas"]) == turn["text"], "deltas join to the text"
        assert turn["deltas"], f"{CLIP_IDS[index]}: a turn over 2 s gets deltas"
    file_texts = [_file_text(client, pcm16) for pcm16 in utterances]
    live_texts = [turn["text"] for turn in turns]
    references = [next(c.text for c in english_clips() if c.id == clip_id) for clip_id in CLIP_IDS]
    gap = word_error_rate(references, live_texts) - word_error_rate(references, file_texts)
    assert gap <= 0.01, (live_texts, file_texts)
    assert word_error_rate(file_texts, live_texts) <= 0.05, (live_texts, file_texts)
    _assert_everything_is_free(server_url)


def test_manual_commits_complete_each_turn_with_deltas_joining_to_the_text(client, server_url):
    utterances = _utterances(["jfk", "osr72_02"])  # 11 s with pauses in it (one turn when committed), 2 s
    connection = _open(client, None)
    try:
        # At half pace. How far into a turn the first delta comes depends on the machine's cores
        # (every partial pass costs an encoder forward): at real time a slower CI machine got it
        # under a second before the commit. Half pace gives each second of audio two of the
        # machine's, so what is checked is the protocol (deltas before the commit, several of
        # them), not the CPU's speed.
        record = stream_live(connection, utterances, silence_s=0.5, chunk_ms=100, commit=True, pace=0.5)
    finally:
        connection.close()
    assert not record.of_type("input_audio_buffer.speech_started"), "no VAD events with manual turns"
    turns = record.turns()
    assert len(turns) == 2 and len(record.of_type("input_audio_buffer.committed")) == 2
    for turn, pcm16 in zip(turns, utterances):
        assert "".join(delta for _, delta in turn["deltas"]) == turn["text"]
        assert _words_apart(turn["text"], _file_text(client, pcm16)) <= ONE_NEAR_TIE
    while_speaking = [delta for at, delta in turns[0]["deltas"] if at < record.speech_ends_s[0]]
    assert len(while_speaking) >= 2, "partial text comes while the speaker is speaking, and grows"


def test_a_diarized_session_labels_two_voices_turns_consistently_across_its_turns(client):
    # JFK's speech cut in two around one OSR reader's sentence: the third turn is JFK again, but
    # words of his the session has not heard, so it matches him by voice, not by the same audio.
    jfk = load_audio_file(SPEECH_DIR / "jfk.flac")
    halves = (jfk[: len(jfk) // 2], jfk[len(jfk) // 2 :])
    osr = load_audio_file(SPEECH_DIR / "osr72_04.flac")
    utterances = [to_pcm16_24k(samples) for samples in (halves[0], osr, halves[1])]
    connection = _connect(client).enter()
    try:
        assert _recv(connection)["type"] == "session.created"
        transcription = {"model": "whisper-1", "diarize": True}
        connection.session.update(session=transcription_session(None, transcription=transcription))
        updated = _recv(connection)
        assert updated["session"]["audio"]["input"]["transcription"]["diarize"] is True, updated
        # At twice real time (within max_audio_ahead_s): a turn's voice does not depend on the pace.
        record = stream_live(connection, utterances, silence_s=0.3, chunk_ms=100, commit=True, pace=2.0)
    finally:
        connection.close()
    speakers = [event["speaker"] for event in record.of_type(COMPLETED)]
    assert len(speakers) == 3 and speakers[0] == speakers[2] != speakers[1], speakers
    assert speakers[:2] == ["A", "B"], "lettered in the order the speakers first speak"


def test_eight_concurrent_streams_all_complete_and_free_every_block(client, server_url):
    plans = [
        ["tts_01", "osr72_06"],
        ["tts_02", "osr72_07"],
        ["tts_03", "osr72_09"],
        ["tts_04", "osr72_10"],
    ] * 2

    def one_stream(clip_ids: list[str]):
        connection = _open(client, SERVER_VAD)
        try:
            return stream_live(connection, _utterances(clip_ids), silence_s=1.0, chunk_ms=20, timeout_s=180)
        finally:
            connection.close()

    with ThreadPoolExecutor(len(plans)) as pool:
        records = list(pool.map(one_stream, plans))
    for plan, record in zip(plans, records):
        turns = record.turns()
        assert len(turns) == len(plan) and not record.of_type(
            "conversation.item.input_audio_transcription.failed"
        )
        assert all("".join(delta for _, delta in turn["deltas"]) == turn["text"] for turn in turns)
        references = [next(c.text for c in english_clips() if c.id == clip_id) for clip_id in plan]
        assert word_error_rate(references, [turn["text"] for turn in turns]) <= 0.35, [
            t["text"] for t in turns
        ]
    _assert_everything_is_free(server_url)


def test_a_client_that_hangs_up_mid_turn_leaves_nothing_held_and_nothing_in_the_logs(client, server_url):
    """Its passes still out run to their end and free what they hold; what they would send goes
    nowhere, so no process of the app (Serve's proxy included) logs an abandoned stream or task."""
    logs = ray_logs.session_logs()
    sizes = ray_logs.log_sizes(logs)
    utterance = _utterances(["jfk"])[0]
    connection = _open(client, SERVER_VAD)
    # 0.5 s lead silence and 6 s of an 11 s utterance: partial passes are under way.
    stream_live(connection, [utterance], chunk_ms=40, stop_after_bytes=int(6.5 * REALTIME_RATE_HZ * 2))
    connection.close()
    _assert_everything_is_free(server_url)
    assert metric_sum_plain(server_url, "whisper_realtime_sessions") == 0, "the session is gone"
    time.sleep(2)  # a pass that was out has ended by now; its lines, if any, have landed
    written = ray_logs.written_since(sizes, logs)
    troubles = ("GeneratorExit", "Task was destroyed but it is pending", "Traceback", "ERROR")
    troubled = {name: text for name, text in written.items() if any(word in text for word in troubles)}
    assert not troubled, {name: text[-3000:] for name, text in troubled.items()}


def test_a_connection_without_the_api_key_is_refused_and_one_with_it_works(server_url):
    ws_url = server_url.replace("http", "ws") + "/v1/realtime?intent=transcription"
    for headers, subprotocols in [({}, None), ({"Authorization": "Bearer wrong"}, None), ({}, ["realtime"])]:
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            websockets.sync.client.connect(ws_url, additional_headers=headers, subprotocols=subprotocols)
        assert refused.value.response.status_code == 403
    with pytest.raises(websockets.exceptions.InvalidStatus):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="wrong").realtime.connect(
            extra_query={"intent": "transcription"}
        ).enter()
    # The key as a browser sends it: a subprotocol, echoed back with `realtime`.
    with websockets.sync.client.connect(
        ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{API_KEY}"]
    ) as browser:
        assert browser.subprotocol == "realtime"
        assert json.loads(browser.recv(timeout=30))["type"] == "session.created"
    with _connect(openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY)) as connection:
        assert _recv(connection)["type"] == "session.created"


def _send_paced(connection, pcm16: bytes, pace: float, chunk_ms: int = 100) -> None:
    """Append the audio in chunks, ``pace`` seconds of audio per second of wall clock."""
    chunk_bytes = REALTIME_RATE_HZ * 2 * chunk_ms // 1000
    started = time.perf_counter()
    for offset in range(0, len(pcm16), chunk_bytes):
        delay_s = started + offset / (2 * REALTIME_RATE_HZ) / pace - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)
        connection.input_audio_buffer.append(
            audio=base64.b64encode(pcm16[offset : offset + chunk_bytes]).decode()
        )


def test_idle_timeout_fires_timeout_triggered_once_per_quiet_stretch_and_never_during_a_turn(client):
    """Quiet counts in audio time, so the stream goes at three times real time: 2.5 s of silence
    (two stretches of 1 s), a 3 s utterance (longer than the timeout), 2 s of silence (one more)."""
    idle_vad = {**SERVER_VAD, "idle_timeout_ms": 1000}
    connection = _open(client, idle_vad)
    utterance = _utterances(["tts_01"])[0]
    try:
        silence_s = 2.5
        _send_paced(connection, bytes(int(REALTIME_RATE_HZ * silence_s) * 2) + utterance, pace=3.0)
        _send_paced(connection, bytes(REALTIME_RATE_HZ * 2 * 2), pace=3.0)
        events = []
        while sum(e["type"].endswith("transcription.completed") for e in events) < 4:
            events.append(_recv(connection))
    finally:
        connection.close()

    def of_type(kind: str) -> list[dict]:
        return [e for e in events if e["type"] == kind]

    timeouts = of_type("input_audio_buffer.timeout_triggered")
    (started,), (stopped,) = (
        of_type("input_audio_buffer.speech_started"),
        of_type("input_audio_buffer.speech_stopped"),
    )
    committed, completed = of_type("input_audio_buffer.committed"), of_type(COMPLETED)
    assert len(timeouts) == 3, [e["type"] for e in events]
    assert [e["item_id"] for e in committed] == [
        timeouts[0]["item_id"],
        timeouts[1]["item_id"],
        started["item_id"],
        timeouts[2]["item_id"],
    ]
    assert [e["item_id"] for e in completed] == [e["item_id"] for e in committed], "in the order committed"
    assert timeouts[0]["audio_start_ms"] == 0 and timeouts[1]["audio_start_ms"] == timeouts[0]["audio_end_ms"]
    for timeout in timeouts:
        assert 1000 <= timeout["audio_end_ms"] - timeout["audio_start_ms"] <= 1040, timeout
    # None inside the turn: the third stretch starts once speech has stopped.
    assert timeouts[1]["audio_end_ms"] <= started["audio_start_ms"]
    assert timeouts[2]["audio_start_ms"] >= stopped["audio_end_ms"]
    speech_turn = completed[2]
    reference = next(c.text for c in english_clips() if c.id == "tts_01")
    assert word_error_rate([reference], [speech_turn["transcript"]]) <= 0.1, speech_turn["transcript"]
    for timeout, done in zip(timeouts, [completed[0], completed[1], completed[3]]):
        # A quiet stretch is billed, and without speech its text is empty, as a file's silence is
        # (decoded, tiny.en would read digital silence as "you").
        assert done["transcript"] == "", done["transcript"]
        assert done["usage"] == duration_usage((timeout["audio_end_ms"] - timeout["audio_start_ms"]) / 1000)


def test_a_completed_turn_has_usage_and_with_include_its_logprobs_and_bills_the_models_audio_seconds(
    client, server_url
):
    utterance = _utterances(["osr72_05"])[0]
    billed = dict(model="tiny.en", api_key=api_key_label(API_KEY))
    billed_before = labelled_sum(server_url, "whisper_audio_seconds_total", AUTH, **billed)
    connection = _connect(client).enter()
    try:
        created = _recv(connection)
        assert created["session"]["audio"]["input"]["transcription"]["model"] == "tiny.en", (
            "the default model"
        )
        session = transcription_session(None, transcription={"model": "whisper-1", "language": "en"})
        connection.session.update(session={**session, "include": ["item.input_audio_transcription.logprobs"]})
        updated = _recv(connection)
        assert updated["session"]["include"] == ["item.input_audio_transcription.logprobs"], updated
        connection.input_audio_buffer.append(audio=base64.b64encode(utterance).decode())
        connection.input_audio_buffer.commit()
        while (completed := _recv(connection))["type"] != COMPLETED:
            pass
    finally:
        connection.close()
    audio_s = len(utterance) / 2 / REALTIME_RATE_HZ
    assert completed["transcript"] == "Small children came to see him."
    assert completed["usage"] == {"type": "duration", "seconds": round(audio_s, 3)}
    logprobs = completed["logprobs"]
    assert "".join(item["token"] for item in logprobs).strip() == completed["transcript"]
    assert all(item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode()) for item in logprobs)
    billed_after = labelled_sum(server_url, "whisper_audio_seconds_total", AUTH, **billed)
    assert billed_after - billed_before == pytest.approx(audio_s, abs=1e-6), "the turn's seconds, to tiny.en"


def test_each_bad_event_gets_an_error_event_and_the_session_survives(client):
    connection = _open(client, None)
    bad_events = [
        ({"type": "response.create"}, "unknown_event_type"),
        ({"type": "input_audio_buffer.append", "audio": "not base64!!"}, "invalid_base64"),
        (
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"odd").decode()},
            "invalid_audio_format",
        ),
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
        (
            {
                "type": "session.update",
                "session": {"type": "transcription", "audio": {"input": {"format": {"type": "audio/flac"}}}},
            },
            "invalid_value",
        ),
        (
            {
                "type": "transcription_session.update",
                "session": {"input_audio_transcription": {"model": "gpt-9"}},
            },
            "model_not_found",
        ),
        (
            {
                "type": "transcription_session.update",
                "session": {"input_audio_transcription": {"language": "xx"}},
            },
            "invalid_value",
        ),
        # 30 s of audio at once, 20 s more than the 10 s the stream may run ahead of the clock.
        (
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(bytes(30 * 2 * REALTIME_RATE_HZ)).decode(),
            },
            "audio_too_fast",
        ),
    ]
    try:
        for index, (event, code) in enumerate(bad_events):
            connection.send_raw(json.dumps({**event, "event_id": f"client-{index}"}))
            answer = _recv(connection)
            assert answer["type"] == "error", (event, answer)
            assert answer["error"]["code"] == code and answer["error"]["event_id"] == f"client-{index}"
            assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        connection.send_raw("{not json")
        assert _recv(connection)["error"]["code"] == "invalid_json"
        # Still serving: audio appends and a commit transcribes it.
        connection.input_audio_buffer.append(audio=base64.b64encode(_utterances(["osr72_05"])[0]).decode())
        connection.input_audio_buffer.commit()
        assert _recv(connection)["type"] == "input_audio_buffer.committed"
        while (event := _recv(connection))["type"].endswith(".delta"):
            pass
        assert event["type"] == "conversation.item.input_audio_transcription.completed"
        assert event["transcript"] == "Small children came to see him."
    finally:
        connection.close()


def test_beyond_max_sessions_a_connection_gets_an_error_event_and_a_1013_close(client, server_url):
    deadline = time.monotonic() + 10
    while metric_sum_plain(server_url, "whisper_realtime_sessions") > 0:  # earlier tests' sessions
        assert time.monotonic() < deadline
        time.sleep(0.2)
    connections = [_connect(client).enter() for _ in range(MAX_SESSIONS)]
    try:
        for connection in connections:
            assert _recv(connection)["type"] == "session.created"
        with _connect(client) as extra:
            refusal = _recv(extra)
            assert refusal["type"] == "error" and refusal["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                extra.recv_bytes()
            assert closed.value.rcvd.code == 1013
    finally:
        for connection in connections:
            connection.close()


@pytest.mark.parametrize("deployment", ["WhisperDecoder", "WhisperEncoder"])
def test_a_replica_killed_mid_turn_is_replaced_and_the_turn_still_completes(client, server_url, deployment):
    """Runs last in this module: it kills a replica of the shared server (Serve replaces it). The
    kill lands while the turn's partial passes are out, a few seconds before its commit: the passes
    that were on the dead replica fail, and the final pass runs on the replacement."""
    import ray

    utterance = _utterances(["jfk"])[0]  # 11 s, committed by the client as it ends
    connection = _open(client, None)
    try:
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream_live, connection, [utterance], 0.5, 100, True, 0.5, 240.0)
            time.sleep(8.0)
            killed = replica_actor(deployment)
            ray.kill(killed, no_restart=True)
            record = streaming.result()
    finally:
        connection.close()
    assert replica_actor(deployment)._actor_id != killed._actor_id, "Serve replaced the replica"
    assert not record.of_type("conversation.item.input_audio_transcription.failed")
    (turn,) = record.turns()
    # The replacement's final pass gives the file endpoint's text for the same audio.
    assert _words_apart(turn["text"], _file_text(client, utterance)) <= ONE_NEAR_TIE
    _assert_everything_is_free(server_url, within_s=60)
