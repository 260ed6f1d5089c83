"""A diarized request's fields and its answer's shape, without Ray: which fields turn diarization
on and what OpenAI refuses beside diarized_json (over a real multipart upload, Starlette's test
transport), reference clips checked as the ingress decodes them, and speakers put on transcript
segments. The whole app is tests/deployments/test_diarization.py."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from deployments.config import AppConfig, parse_app_config
from deployments.http.errors import APIError, add_exception_handlers
from deployments.http.formats import diarized_segment
from deployments.http.forms import parse_transcription_form
from deployments.http.pending_uploads import PendingUploads
from deployments.http.segments import Segment, Word
from deployments.http.speakers import Speakers, decode_references, letter_label, parse_known_speakers
from engine import SAMPLE_RATE, decode_audio
from engine.diarize import SpeakerTurn
from tests.support.encoding import UploadFormat, encode
from tests.support.serving import default_app_args

WAV = UploadFormat("wav-16bit", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE)
NAMES, REFERENCES = "known_speaker_names[]", "known_speaker_references[]"


def form_client(config: AppConfig) -> TestClient:
    app = FastAPI()
    add_exception_handlers(app)
    http = config.http
    pending = PendingUploads(
        http.max_pending_uploads, http.max_pending_uploads_per_address, http.min_upload_bytes_per_s
    )

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> dict:
        form = await parse_transcription_form(request, "transcribe", config, pending)
        speakers = form.speakers
        return {
            "diarized": speakers is not None,
            "word_timestamps": form.options.word_timestamps,
            "bounds": None if speakers is None else [speakers.min_speakers, speakers.max_speakers],
            "names": None if speakers is None or not speakers.references else list(speakers.references),
        }

    return TestClient(app)


@pytest.fixture(scope="module")
def shipped() -> TestClient:
    return form_client(parse_app_config(default_app_args()))


def post(client: TestClient, fields: list[tuple[str, str]]) -> dict:
    """``fields`` in order; a name given twice is a list field sent twice."""
    data: dict[str, list[str]] = {"model": ["whisper-1"]}
    for name, value in fields:
        data.setdefault(name, []).append(value)
    response = client.post(
        "/v1/audio/transcriptions",
        data=data,
        files={"file": ("clip.wav", b"RIFF")},  # never decoded here
    )
    return {"status": response.status_code, **response.json()}


def data_url(seconds: float) -> str:
    tone = 0.1 * np.sin(np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE * 2 * np.pi * 220)
    return "data:audio/wav;base64," + base64.b64encode(encode(tone.astype(np.float32), WAV)).decode()


# ---- fields ---------------------------------------------------------------------------------------


def test_diarized_json_and_diarize_with_verbose_json_are_diarized_with_word_timestamps(shipped):
    for fields in (
        [("response_format", "diarized_json")],
        [("response_format", "verbose_json"), ("diarize", "true")],
    ):
        answer = post(shipped, fields)
        assert answer["status"] == 200 and answer["diarized"] and answer["word_timestamps"], answer
    plain = post(shipped, [("response_format", "verbose_json")])
    assert not plain["diarized"] and not plain["word_timestamps"]


def test_speaker_bounds_and_known_speakers_reach_the_form(shipped):
    answer = post(
        shipped,
        [
            ("response_format", "diarized_json"),
            ("min_speakers", "2"),
            ("max_speakers", "3"),
            (NAMES, "agent"),
            (REFERENCES, data_url(3)),
            (NAMES, "customer"),
            (REFERENCES, data_url(4)),
        ],
    )
    assert answer["status"] == 200, answer
    assert answer["bounds"] == [2, 3] and answer["names"] == ["agent", "customer"]


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            [("response_format", "diarized_json"), ("timestamp_granularities[]", "segment")],
            "timestamp_granularities[]",
        ),
        ([("response_format", "diarized_json"), ("prompt", "Hello.")], "prompt"),
        ([("response_format", "diarized_json"), ("include[]", "logprobs")], "include[]"),
        ([("response_format", "json"), ("diarize", "true")], "diarize"),
        ([("response_format", "json"), ("min_speakers", "2")], "min_speakers"),
        ([(NAMES, "agent"), (REFERENCES, "data:audio/wav;base64,AAAA")], NAMES),
        (
            [("response_format", "diarized_json"), ("min_speakers", "4"), ("max_speakers", "2")],
            "min_speakers",
        ),
        ([("response_format", "diarized_json"), ("max_speakers", "0")], "max_speakers"),
        ([("response_format", "diarized_json"), (NAMES, "agent")], NAMES),
        ([("response_format", "diarized_json"), (REFERENCES, "data:audio/wav;base64,AAAA")], NAMES),
        (
            [("response_format", "diarized_json"), (NAMES, "a"), (NAMES, "b"), (REFERENCES, "data:,x")],
            REFERENCES,
        ),
        (
            [("response_format", "diarized_json"), (NAMES, "a"), (REFERENCES, "https://example.com/a.wav")],
            REFERENCES,
        ),
        (
            [("response_format", "diarized_json"), (NAMES, "a"), (REFERENCES, "data:audio/wav;base64,@@@")],
            REFERENCES,
        ),
    ],
)
def test_openais_refusals_and_bad_speaker_fields_are_400s_naming_the_field(shipped, fields, param):
    answer = post(shipped, fields)
    assert answer["status"] == 400, answer
    assert answer["error"]["param"] == param
    assert "Traceback" not in answer["error"]["message"]


def test_more_than_four_known_speakers_is_a_400():
    references = {f"n{i}": "data:audio/wav;base64,AAAA" for i in range(5)}
    with pytest.raises(APIError) as refused:
        parse_known_speakers(list(references), list(references.values()))
    assert refused.value.param == REFERENCES and "at most 4" in refused.value.message


def test_a_server_without_a_diarizer_refuses_diarized_json_in_words():
    config = parse_app_config({**default_app_args(), "diarizer": None})
    answer = post(form_client(config), [("response_format", "diarized_json")])
    assert answer["status"] == 400 and answer["error"]["code"] == "diarization_unavailable"


# ---- references -----------------------------------------------------------------------------------


def test_references_of_two_to_ten_seconds_decode_and_others_are_400s_saying_why():
    decoded = decode_references({"agent": base64.b64decode(data_url(3).split(",", 1)[1])}, decode_audio)
    assert abs(len(decoded["agent"]) / SAMPLE_RATE - 3) < 0.05
    for seconds, words in ((1.0, "1.0 s"), (12.0, "more than 10")):
        with pytest.raises(APIError) as refused:
            decode_references({"agent": base64.b64decode(data_url(seconds).split(",", 1)[1])}, decode_audio)
        assert refused.value.param == REFERENCES and words in refused.value.message
    with pytest.raises(APIError) as refused:
        decode_references({"agent": b"these bytes are not audio"}, decode_audio)
    assert refused.value.param == REFERENCES and "not audio" in refused.value.message


# ---- speakers on segments -------------------------------------------------------------------------


TURNS = [
    SpeakerTurn(0, 0.0, 2.0),
    SpeakerTurn(1, 2.0, 4.0),
    SpeakerTurn(2, 4.0, 6.0),
    SpeakerTurn(0, 6.0, 8.0),
]


def segment(segment_id: int, words: list[tuple[str, float, float]]) -> Segment:
    text = "".join(word for word, _, _ in words)
    timed = [Word(word, start_s, end_s) for word, start_s, end_s in words]
    return Segment(segment_id, words[0][1], words[-1][2], text, [], 0.0, 0.0, 1.0, 0.0, timed)


def test_a_segment_is_cut_where_the_speaker_changes_and_speakers_are_lettered_in_order_of_appearance():
    segments = [
        segment(0, [(" Hello", 0.2, 0.8), (" there.", 0.9, 1.8), (" Hi!", 2.2, 2.9)]),
        segment(1, [(" Yes", 4.1, 4.6), (" and", 6.2, 6.5), (" so.", 6.6, 7.2)]),
    ]
    spoken = Speakers(TURNS, {}).spoken_segments(segments)
    assert [(s.text, s.speaker) for s in spoken] == [
        (" Hello there.", "A"),
        (" Hi!", "B"),
        (" Yes", "C"),
        (" and so.", "A"),
    ]
    assert [diarized_segment(s)["id"] for s in spoken] == ["seg_0", "seg_1", "seg_2", "seg_3"]
    assert [(s.start_s, s.end_s) for s in spoken] == [(0.2, 1.8), (2.2, 2.9), (4.1, 4.6), (6.2, 7.2)]


def test_known_names_replace_letters_and_the_others_are_lettered_from_a():
    segments = [segment(0, [(" One", 0.5, 1.0), (" two", 2.5, 3.0), (" three", 4.5, 5.0)])]
    spoken = Speakers(TURNS, {1: "agent"}).spoken_segments(segments)
    assert [s.speaker for s in spoken] == ["A", "agent", "B"]


def test_a_stream_labels_later_segments_as_it_labelled_earlier_ones():
    speakers = Speakers(TURNS, {})
    first = speakers.spoken_segments([segment(0, [(" Hi", 2.5, 3.0)])])
    later = speakers.spoken_segments([segment(1, [(" Hello", 0.5, 1.0), (" again", 2.2, 2.6)])], first_id=1)
    assert [s.speaker for s in first + later] == ["A", "B", "A"]
    assert [s.id for s in later] == [1, 2]


def test_letters_run_past_z():
    assert [letter_label(index) for index in (0, 25, 26, 27, 51, 52)] == ["A", "Z", "AA", "AB", "AZ", "BA"]
