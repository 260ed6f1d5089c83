"""Who said what, through the default app (its diarizer deployment included) on a real local Ray
Serve and the official openai client: diarized_json's error rate against engine/diarize run here
on the same audio, known speakers named from references, the diarized stream, a stereo call split
by channel, the diarizer in /ready and /metrics, OpenAI's refusals, and a diarizer replica killed
mid-request."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from pyannote.core import Annotation, Segment
from pyannote.metrics.diarization import DiarizationErrorRate

from engine.diarize import DiarizationRequest, Diarizer, SpeakerEncoderOptions, word_speakers
from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.types import TimedWord
from tests.support.app_metrics import metric_sum, scrape
from tests.support.conversations import Conversation, conversation, stereo_call
from tests.support.encoding import UploadFormat, encode, encode_channels
from tests.support.serving import default_app_args, replica_actor, running_app
from tests.support.speech import SPEECH_DIR

pytestmark = pytest.mark.ray

WAV = UploadFormat("wav-16bit", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE)
COLLAR_S = 0.25


@pytest.fixture(scope="module")
def server_url():
    # tests/deployments/test_ingest.py's app, which runs just before (conftest's SHARED_APP_MODULES)
    # and leaves it running: its bound on a file's length is twice this module's longest.
    args = default_app_args()
    with running_app({**args, "http": {**args["http"], "max_audio_duration_s": 120}}, shared=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def talk() -> Conversation:
    """Three voices taking turns for about a minute, with pauses and overlaps."""
    return conversation("three_speakers", ["osr", "multi_en", "tts_m3"], 60.0, seed=3)


@pytest.fixture(scope="module")
def talk_wav(talk) -> bytes:
    return encode(talk.samples, WAV)


@pytest.fixture(scope="module")
def diarized(client, talk_wav):
    return client.audio.transcriptions.create(
        model="whisper-1", file=("talk.wav", talk_wav), response_format="diarized_json"
    )


def _annotation(triples) -> Annotation:
    result = Annotation()
    for speaker, start_s, end_s in triples:
        if end_s > start_s:
            result[Segment(start_s, end_s)] = speaker
    return result


def _reference(talk: Conversation) -> Annotation:
    return _annotation([(turn.speaker, turn.start_s, turn.end_s) for turn in talk.turns])


def _word_runs(words: list[dict], speakers: list) -> Annotation:
    """Runs of consecutive words of one speaker, as diarized_json cuts its segments."""
    runs: list[list] = []
    for word, speaker in zip(words, speakers):
        if runs and runs[-1][0] == speaker:
            runs[-1][2] = word["end"]
        else:
            runs.append([speaker, word["start"], word["end"]])
    return _annotation(runs)


def _data_url(samples: np.ndarray) -> str:
    return "data:audio/wav;base64," + base64.b64encode(encode(samples, WAV)).decode()


def _grouped(fields: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Form fields as httpx sends them: a name given twice is a list field sent twice."""
    data: dict[str, list[str]] = {}
    for name, value in fields:
        data.setdefault(name, []).append(value)
    return data


def _words(text: str) -> list[str]:
    return text.split()


# ---- diarized_json --------------------------------------------------------------------------------


def test_diarized_json_has_openais_fields_and_letters_speakers_in_order_of_first_appearance(diarized):
    assert diarized.task == "transcribe" and diarized.duration > 55
    assert diarized.usage.type == "duration" and diarized.usage.seconds == diarized.duration
    assert len(diarized.segments) >= 5
    assert all(s.type == "transcript.text.segment" for s in diarized.segments)
    assert len({s.id for s in diarized.segments}) == len(diarized.segments)
    assert all(s.start <= s.end for s in diarized.segments)
    order = list(dict.fromkeys(s.speaker for s in diarized.segments))
    assert order == [chr(ord("A") + index) for index in range(len(order))]
    assert len(order) >= 2
    # The segments are the transcript, cut where the speaker changes.
    assert _words("".join(s.text for s in diarized.segments)) == _words(diarized.text)


def test_served_diarization_errs_within_a_point_of_engine_diarize_run_here_on_the_same_audio(
    client, talk, talk_wav, diarized
):
    """The app's diarized_json segments against the same transcript's words given to speakers by
    engine/diarize run in this process: the serving path (batching, transport, threads) loses
    nothing. Word-level attribution is printed."""
    verbose = client.audio.transcriptions.create(
        model="whisper-1",
        file=("talk.wav", talk_wav),
        response_format="verbose_json",
        timestamp_granularities=["word"],
        extra_body={"diarize": "true"},
    )
    words = [word.model_dump() for word in verbose.words]
    assert words and all("speaker" in word for word in words)
    (direct,) = Diarizer(SpeakerEncoderOptions(threads=1)).diarize([DiarizationRequest(talk.samples)])
    timed = [TimedWord(word["word"], word["start"], word["end"], []) for word in words]
    direct_runs = _word_runs(words, word_speakers(timed, direct.turns))
    served = _annotation([(s.speaker, s.start, s.end) for s in diarized.segments])
    reference = _reference(talk)
    served_der = DiarizationErrorRate(collar=COLLAR_S)(reference, served)
    direct_der = DiarizationErrorRate(collar=COLLAR_S)(reference, direct_runs)
    turns_der = DiarizationErrorRate(collar=COLLAR_S)(
        reference, _annotation([(t.speaker, t.start_s, t.end_s) for t in direct.turns])
    )
    # Word attribution: each word's speaker (verbose_json, mapped to the construction's voices)
    # against the voice whose reference turn overlaps the word most.
    hypothesis_words = _word_runs(words, [word["speaker"] for word in words])
    mapping = DiarizationErrorRate().optimal_mapping(reference, hypothesis_words)
    truth = [
        max(
            talk.turns,
            key=lambda turn: min(word["end"], turn.end_s) - max(word["start"], turn.start_s),
        ).speaker
        for word in words
    ]
    accuracy = np.mean([mapping.get(word["speaker"]) == true for word, true in zip(words, truth)])
    print(
        f"\n{talk.name} ({talk.duration_s:.0f} s): DER served {served_der:.3f}, engine/diarize on the same "
        f"words {direct_der:.3f}, engine/diarize turns {turns_der:.3f}; word attribution {accuracy:.3f} "
        f"over {len(words)} words; speakers served {len(set(s.speaker for s in diarized.segments))}, "
        f"direct {direct.num_speakers}"
    )
    assert served_der <= direct_der + 0.01


# ---- known speakers -------------------------------------------------------------------------------


def _reference_clip(voice: str) -> np.ndarray:
    if voice == "osr":
        clips = [load_audio_file(SPEECH_DIR / f"osr72_0{index}.flac") for index in (1, 2, 3, 4)]
        return np.concatenate(clips)[: 9 * SAMPLE_RATE]
    return load_audio_file(SPEECH_DIR / "multilingual.flac")[int(1.7 * SAMPLE_RATE) : int(9.7 * SAMPLE_RATE)]


def test_with_references_for_two_of_three_speakers_those_two_are_named_and_the_third_keeps_a_letter(
    client, talk_wav, diarized
):
    named = client.audio.transcriptions.create(
        model="whisper-1",
        file=("talk.wav", talk_wav),
        response_format="diarized_json",
        known_speaker_names=["reader", "interviewee"],
        known_speaker_references=[_data_url(_reference_clip("osr")), _data_url(_reference_clip("multi_en"))],
    )
    labels = {s.speaker for s in named.segments}
    assert {"reader", "interviewee"} <= labels
    letters = labels - {"reader", "interviewee"}
    assert letters and all(label.isalpha() and label.isupper() for label in letters)
    assert "A" in letters  # the unnamed voices are lettered from A
    # Names replace letters, speaker for speaker: the same segments with the same cuts.
    assert [(s.start, s.end, s.text) for s in named.segments] == [
        (s.start, s.end, s.text) for s in diarized.segments
    ]
    renamed = {}
    for plain, known in zip(diarized.segments, named.segments):
        assert renamed.setdefault(plain.speaker, known.speaker) == known.speaker


# ---- streaming ------------------------------------------------------------------------------------


def test_a_diarized_stream_sends_speaker_segments_that_join_to_the_done_text(client, talk_wav, diarized):
    events = list(
        client.audio.transcriptions.create(
            model="whisper-1", file=("talk.wav", talk_wav), response_format="diarized_json", stream=True
        )
    )
    assert events[-1].type == "transcript.text.done"
    segments = [event for event in events if event.type == "transcript.text.segment"]
    assert segments and all(event.speaker for event in segments)
    assert "".join(event.text for event in segments).strip() == events[-1].text
    assert events[-1].text == diarized.text
    assert [(s.start, s.end, s.text, s.speaker) for s in segments] == [
        (s.start, s.end, s.text, s.speaker) for s in diarized.segments
    ]


# ---- channels as speakers ------------------------------------------------------------------------


def test_the_stereo_calls_segments_carry_the_right_channel_on_every_segment(client):
    """channels=split: each party's channel transcribed on its own; every segment is labelled
    with the channel of the party whose reference turns it overlaps most, and both parties speak."""
    call = stereo_call(60.0)
    upload = encode_channels(call.samples, WAV, "stereo")
    answer = client.audio.transcriptions.create(
        model="whisper-1",
        file=("call.wav", upload),
        response_format="diarized_json",
        extra_body={"channels": "split"},
    )
    segments = [segment.model_dump() for segment in answer.segments]
    assert len(segments) >= 4 and {s["channel"] for s in segments} == {0, 1}
    for segment in segments:
        overlap = {
            party: sum(
                max(0.0, min(segment["end"], t.end_s) - max(segment["start"], t.start_s))
                for t in call.turns
                if t.speaker == party
            )
            for party in call.speakers
        }
        assert max(overlap, key=overlap.get) == call.speakers[segment["channel"]], (segment, overlap)
        assert segment["speaker"] == "AB"[segment["channel"]]
    assert [s["start"] for s in segments] == sorted(s["start"] for s in segments)
    assert _words(" ".join(s["text"] for s in segments)) == _words(answer.text)
    assert answer.duration == pytest.approx(call.samples.shape[1] / SAMPLE_RATE, abs=0.01)


# ---- readiness and metrics ------------------------------------------------------------------------


def test_the_app_is_ready_with_its_diarizer_and_counts_what_the_diarizer_did(server_url, talk, diarized):
    deadline = time.monotonic() + 120
    while (probe := httpx.get(f"{server_url}/ready", timeout=30)).status_code == 503:
        assert time.monotonic() < deadline, probe.json()
        time.sleep(0.2)
    assert probe.json()["diarizer"]["ready"] is True
    figures = scrape(server_url)
    assert figures["whisper_diarizer_recordings"] >= 1 and figures["whisper_diarizer_batches"] >= 1
    assert figures["whisper_diarizer_audio_seconds"] >= talk.duration_s - 0.1
    assert figures["whisper_diarizer_busy_seconds"] > 0
    assert figures["whisper_diarizer_voices"] >= 1  # the readiness probe's warm-up clip
    # The default app cuts windows at speech, so the ingress's Silero pass went to the diarizer.
    assert figures["whisper_diarizer_own_speech_passes"] == 0
    assert figures["whisper_diarizer_waiting"] == 0


# ---- refusals -------------------------------------------------------------------------------------


def _refusal(server_url: str, fields: dict, files: dict | None = None) -> dict:
    data = {"model": "whisper-1", **fields}
    response = httpx.post(
        f"{server_url}/v1/audio/transcriptions",
        data=data,
        files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes()), **(files or {})},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"] and "b'" not in error["message"]
    return error


def test_openais_refusals_and_bad_speaker_references_are_400s_naming_the_field(server_url):
    two_s, one_s, twelve_s = (
        _data_url(np.tile(_reference_clip("osr"), 2)[: round(seconds * SAMPLE_RATE)])
        for seconds in (3, 1, 12)
    )
    diarized = {"response_format": "diarized_json"}
    cases = [
        ({**diarized, "timestamp_granularities[]": "segment"}, "timestamp_granularities[]"),
        ({**diarized, "prompt": "A meeting."}, "prompt"),
        ({**diarized, "include[]": "logprobs"}, "include[]"),
        ({"known_speaker_names[]": "agent", "known_speaker_references[]": two_s}, "known_speaker_names[]"),
        ({"diarize": "true"}, "diarize"),
        ({**diarized, "known_speaker_names[]": "agent"}, "known_speaker_names[]"),
        ({**diarized, "known_speaker_references[]": two_s}, "known_speaker_names[]"),
        (
            {**diarized, "known_speaker_names[]": "agent", "known_speaker_references[]": "https://x/a.wav"},
            "known_speaker_references[]",
        ),
        (
            {
                **diarized,
                "known_speaker_names[]": "agent",
                "known_speaker_references[]": "data:audio/wav;base64,"
                + base64.b64encode(b"not audio").decode(),
            },
            "known_speaker_references[]",
        ),
        (
            {**diarized, "known_speaker_names[]": "agent", "known_speaker_references[]": one_s},
            "known_speaker_references[]",
        ),
        (
            {**diarized, "known_speaker_names[]": "agent", "known_speaker_references[]": twelve_s},
            "known_speaker_references[]",
        ),
        ({**diarized, "min_speakers": "3", "max_speakers": "2"}, "min_speakers"),
        ({**diarized, "max_speakers": "zero"}, "max_speakers"),
    ]
    for fields, param in cases:
        error = _refusal(server_url, fields)
        assert error["param"] == param, (fields.keys(), error)
    # Lists: five references, and counts that differ.
    five = [("known_speaker_names[]", f"s{i}") for i in range(5)] + [
        ("known_speaker_references[]", two_s)
    ] * 5
    unequal = [
        ("known_speaker_names[]", "a"),
        ("known_speaker_names[]", "b"),
        ("known_speaker_references[]", two_s),
    ]
    for pairs, words in ((five, "at most 4"), (unequal, "one reference per name")):
        response = httpx.post(
            f"{server_url}/v1/audio/transcriptions",
            data=_grouped([("model", "whisper-1"), ("response_format", "diarized_json"), *pairs]),
            files={"file": ("jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes())},
            timeout=120,
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "known_speaker_references[]" and words in error["message"]


# ---- faults (last: they replace the diarizer replica) --------------------------------------------


def test_a_diarizer_replica_killed_mid_request_still_answers_and_leaves_nothing_held(
    client, server_url, talk_wav, diarized
):
    import ray

    def diarize():
        return client.audio.transcriptions.create(
            model="whisper-1", file=("talk.wav", talk_wav), response_format="diarized_json"
        )

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(diarize)
        time.sleep(2.0)  # the audio is decoded and at the diarizer and the encoder now
        assert not answer.done()
        ray.kill(replica_actor("WhisperDiarizer"), no_restart=True)
        result = answer.result()
    assert result.text == diarized.text
    assert [(s.start, s.end, s.speaker) for s in result.segments] == [
        (s.start, s.end, s.speaker) for s in diarized.segments
    ]
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used") == 0
    assert metric_sum(server_url, "whisper_encoder_staged") == 0
    assert metric_sum(server_url, "whisper_diarizer_waiting") == 0
    assert metric_sum(server_url, "whisper_diarizer_recordings") >= 1  # the replacement diarized it
