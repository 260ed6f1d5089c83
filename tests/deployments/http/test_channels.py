"""channels=split without Ray: which requests may split (over a real multipart upload, Starlette's
test transport), and every channel's segments put together in time order, each labelled with its
channel. The whole app on a stereo call is in tests/deployments/test_diarization.py."""

from __future__ import annotations

import pytest

from deployments.config import parse_app_config
from deployments.http.channels import to_channel_diarized_json, to_channel_verbose_json
from engine import Transcription, WindowTimeline
from engine.model.audio import SAMPLE_RATE
from engine.types import DecodeResult, FinishReason, TimedText, TimedWord
from tests.deployments.http.test_speakers import form_client, post
from tests.support.serving import default_app_args


@pytest.fixture(scope="module")
def shipped():
    return form_client(parse_app_config(default_app_args()))


@pytest.fixture(scope="module")
def without_diarizer():
    args = default_app_args()
    args.pop("diarizer", None)
    return form_client(parse_app_config(args))


def test_split_channels_are_accepted_for_the_formats_with_segments_and_never_ask_the_diarizer(
    shipped, without_diarizer
):
    for client in (shipped, without_diarizer):
        for response_format in ("verbose_json", "diarized_json"):
            answer = post(client, [("response_format", response_format), ("channels", "split")])
            assert answer["status"] == 200, answer
            assert answer["diarized"] is False  # the channels are the speakers
    mixed = post(shipped, [("response_format", "verbose_json"), ("channels", "mix")])
    assert mixed["status"] == 200


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ([("channels", "left")], "channels", "expected 'mix' or 'split'"),
        ([("channels", "split")], "channels", "response_format 'json' has no segments"),
        ([("channels", "split"), ("response_format", "srt")], "channels", "has no segments"),
        (
            [("channels", "split"), ("response_format", "verbose_json"), ("stream", "true")],
            "channels",
            "not streamed",
        ),
        (
            [("channels", "split"), ("response_format", "diarized_json"), ("min_speakers", "2")],
            "min_speakers",
            "each channel is one speaker",
        ),
        (
            [("channels", "split"), ("response_format", "diarized_json"), ("prompt", "A call.")],
            "prompt",
            "not supported with response_format diarized_json",
        ),
    ],
)
def test_requests_that_cannot_split_their_channels_are_400s_naming_the_field(shipped, fields, param, words):
    answer = post(shipped, fields)
    assert answer["status"] == 400
    assert answer["error"]["param"] == param and words in answer["error"]["message"]


def _channel(pieces: list[tuple[float, float, str]], duration_s: float = 10.0) -> Transcription:
    """One channel's transcript: one window from the file's start, its segments as given."""
    segments = [
        TimedText(start, end, text, [], words=[TimedWord(text, start, end, [])])
        for start, end, text in pieces
    ]
    window = DecodeResult(
        "r",
        [],
        "".join(text for _, _, text in pieces),
        -0.1,
        0.0,
        "en",
        0.0,
        FinishReason.STOP,
        segments=segments,
    )
    timeline = WindowTimeline(((0, 0),), int(duration_s * SAMPLE_RATE))
    return Transcription(window.text, "en", duration_s, [window], [timeline])


AGENT = _channel([(0.5, 2.0, " Hello, how can I help?"), (5.0, 6.0, " Sure.")])
CUSTOMER = _channel([(2.2, 4.8, " My order is late."), (5.5, 7.0, " Thanks.")])


def test_split_diarized_json_puts_every_channels_segments_in_time_order_each_with_its_channel():
    body = to_channel_diarized_json([AGENT, CUSTOMER], 10.0)
    assert [(s["channel"], s["speaker"], s["text"]) for s in body["segments"]] == [
        (0, "A", " Hello, how can I help?"),
        (1, "B", " My order is late."),
        (0, "A", " Sure."),
        (1, "B", " Thanks."),
    ]
    assert [s["id"] for s in body["segments"]] == ["seg_0", "seg_1", "seg_2", "seg_3"]
    assert all(s["type"] == "transcript.text.segment" for s in body["segments"])
    assert body["text"] == "Hello, how can I help? My order is late. Sure. Thanks."
    assert body["duration"] == 10.0 and body["usage"] == {"type": "duration", "seconds": 10.0}


def test_split_verbose_json_labels_segments_and_words_with_their_channel():
    body = to_channel_verbose_json([AGENT, CUSTOMER], 10.0, "transcribe", ("word", "segment"))
    assert [(s["id"], s["channel"], s["speaker"]) for s in body["segments"]] == [
        (0, 0, "A"),
        (1, 1, "B"),
        (2, 0, "A"),
        (3, 1, "B"),
    ]
    assert [(w["word"], w["channel"]) for w in body["words"]] == [
        ("Hello, how can I help?", 0),
        ("My order is late.", 1),
        ("Sure.", 0),
        ("Thanks.", 1),
    ]
    assert body["language"] == "en" and body["usage"]["seconds"] == 10.0
