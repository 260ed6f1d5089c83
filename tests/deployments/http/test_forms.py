"""A transcription request's fields as the ingress reads them, over a real multipart upload
(Starlette's test transport) without Ray: which timestamp granularities each response format takes,
and when the audio goes through speech detection. The whole app over the official client is
tests/deployments/test_ingest.py."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from deployments.config import AppConfig, parse_app_config
from deployments.http.errors import MAX_MESSAGE_CHARS, APIError, add_exception_handlers
from deployments.http.forms import parse_transcription_form
from deployments.http.pending_uploads import PendingUploads
from engine import SpeechOptions
from engine.errors import QUOTED_CHARS
from tests.support.serving import default_app_args

GRANULARITIES = "timestamp_granularities[]"
AUTO = dataclasses.asdict(SpeechOptions())  # chunking_strategy=auto's speech detection


def form_client(config: AppConfig) -> TestClient:
    """The transcription route with the ingress's form parsing and error answers, replying with
    what it parsed instead of transcribing."""
    app = FastAPI()
    add_exception_handlers(app)
    http = config.http
    pending = PendingUploads(
        http.max_pending_uploads, http.max_pending_uploads_per_address, http.min_upload_bytes_per_s
    )

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> dict:
        form = await parse_transcription_form(request, "transcribe", config, pending)
        return {
            "model": form.model,
            "granularities": list(form.timestamp_granularities),
            "timestamps": form.options.timestamps,
            "word_timestamps": form.options.word_timestamps,
            "speech": None if form.speech is None else dataclasses.asdict(form.speech),
        }

    return TestClient(app)


def post(client: TestClient, **fields) -> dict:
    """The response's status and JSON body for a request with ``fields`` (lists repeat the field,
    as the official client sends `timestamp_granularities[]`)."""
    response = client.post(
        "/v1/audio/transcriptions",
        data={"model": "whisper-1", **fields},
        files={"file": ("clip.wav", b"RIFF")},  # never decoded here
    )
    return {"status": response.status_code, **response.json()}


@pytest.fixture(scope="module")
def shipped() -> TestClient:
    """Parsing with the config `make serve` runs (configs/default.yaml)."""
    return form_client(parse_app_config(default_app_args()))


@pytest.mark.parametrize("response_format", ["json", "text", "srt", "vtt"])
def test_segment_granularity_is_accepted_by_formats_without_segments_and_changes_nothing(
    shipped, response_format
):
    plain = post(shipped, response_format=response_format)
    with_segments = post(shipped, response_format=response_format, **{GRANULARITIES: ["segment"]})
    assert with_segments["status"] == 200, with_segments
    assert with_segments["granularities"] == ["segment"]
    # Decoded as without the field: srt and vtt have segment times anyway, json and text none.
    assert (with_segments["timestamps"], with_segments["word_timestamps"]) == (plain["timestamps"], False)


@pytest.mark.parametrize("response_format", ["json", "text", "srt", "vtt"])
@pytest.mark.parametrize("granularities", [["word"], ["segment", "word"]], ids=["word", "segment-word"])
def test_word_granularity_is_a_400_in_openais_error_shape_unless_the_format_is_verbose_json(
    shipped, response_format, granularities
):
    refused = post(shipped, response_format=response_format, **{GRANULARITIES: granularities})
    assert refused["status"] == 400
    error = refused["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == GRANULARITIES and error["type"] == "invalid_request_error"
    assert "verbose_json" in error["message"] and response_format in error["message"]
    accepted = post(shipped, response_format="verbose_json", **{GRANULARITIES: granularities})
    assert accepted["status"] == 200 and accepted["word_timestamps"] is True


def test_an_unknown_granularity_is_still_a_400_with_any_format(shipped):
    for response_format in ("json", "verbose_json"):
        refused = post(shipped, response_format=response_format, **{GRANULARITIES: ["sentence"]})
        assert refused["status"] == 400 and refused["error"]["param"] == GRANULARITIES


def test_the_shipped_config_detects_speech_unless_a_request_asks_for_quiet_point_cuts(shipped):
    assert post(shipped)["speech"] == AUTO, "no chunking_strategy: speech only"
    assert post(shipped, chunking_strategy="auto")["speech"] == AUTO
    assert post(shipped, chunking_strategy="none")["speech"] is None
    # Sequential long-form seeks through all the audio: the server's default leaves it alone.
    assert post(shipped, long_form="sequential")["speech"] is None
    refused = post(shipped, chunking_strategy="never")
    assert refused["status"] == 400 and refused["error"]["param"] == "chunking_strategy"
    assert '"none"' in refused["error"]["message"]


def test_speech_detection_is_on_without_a_config_and_off_only_where_the_config_says_so():
    assert post(form_client(AppConfig()))["speech"] == AUTO
    without = form_client(parse_app_config({"http": {"vad_by_default": False}}))
    assert post(without)["speech"] is None
    assert post(without, chunking_strategy="auto")["speech"] == AUTO


def test_the_form_names_the_model_that_serves_it_for_an_alias_too(shipped):
    assert [post(shipped, model=name)["model"] for name in ("whisper-1", "tiny.en")] == ["tiny.en", "tiny.en"]


HUGE = "x" * 10_000 + "\nforged log line"


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": HUGE},
        {"temperature": HUGE},
        {"long_form": HUGE},
        {"model": HUGE},
        {"beam_size": HUGE},
        {"chunking_strategy": HUGE},
        {GRANULARITIES: [HUGE, HUGE]},
    ],
    ids=[
        "response_format",
        "temperature",
        "long_form",
        "model",
        "beam_size",
        "chunking_strategy",
        "granularities",
    ],
)
def test_an_error_quotes_at_most_a_hundred_characters_of_a_huge_field(shipped, fields):
    answer = post(shipped, **fields)
    message = answer["error"]["message"]
    assert answer["status"] in (400, 404)
    assert "x" * QUOTED_CHARS in message and "x" * (QUOTED_CHARS + 1) not in message
    assert "10016 characters" in message and "\n" not in message
    assert len(message) <= MAX_MESSAGE_CHARS


def test_no_error_message_is_longer_than_the_bound_whatever_it_holds():
    assert len(APIError(400, "y" * 5000).message) == MAX_MESSAGE_CHARS
    assert APIError(400, "short").message == "short"


def test_an_unknown_url_is_quoted_cut_short_too():
    client = TestClient(FastAPI())
    add_exception_handlers(client.app)
    message = client.get("/" + "p" * 5000).json()["error"]["message"]
    assert message.startswith("Unknown request URL: GET '/ppp") and len(message) < 200


def test_the_shipped_config_refuses_the_benchmark_only_field_from_any_client(shipped):
    answer = post(shipped, fixed_output_tokens="1000000000")
    assert answer["status"] == 400 and answer["error"]["param"] == "fixed_output_tokens"
    assert "for benchmarks only" in answer["error"]["message"]
