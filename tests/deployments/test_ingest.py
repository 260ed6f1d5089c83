"""What users upload, through the default app on a real local Ray Serve and the official openai
client: every audio format OpenAI's API accepts, silence and noise with speech detection on (the
shipped config's default) and off, broken files, and the request fields, routes and usage figures
around them that OpenAI's API has."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.transcribe.evaluation import word_error_rate
from tests.support.app_metrics import labelled_sum
from tests.support.encoding import (
    UPLOAD_FORMATS,
    UploadFormat,
    encode,
    flac_claiming,
    video_only_mp4,
    zip_archive,
)
from tests.support.noise import NoiseClip, noise_set
from tests.support.serving import default_app_args, running_app
from tests.support.speech import SPEECH_DIR, english_clips

pytestmark = pytest.mark.ray

MAX_AUDIO_S = 120
SILENCE_S = 45
FLAC = UploadFormat("flac", "flac", "flac", "flac", "s16", SAMPLE_RATE)
WAV = UploadFormat("wav-16bit", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE)


@pytest.fixture(scope="module")
def server_url():
    # Shared with tests/deployments/test_diarization.py, which runs next with the same settings.
    args = default_app_args()
    with running_app(
        {**args, "http": {**args["http"], "max_audio_duration_s": MAX_AUDIO_S}}, shared=True
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _transcribe(client: openai.OpenAI, name: str, data: bytes, **kwargs):
    return client.audio.transcriptions.create(model="whisper-1", file=(name, data), **kwargs)


def _jfk_answers(client: openai.OpenAI) -> bool:
    return (
        "ask not what your country"
        in _transcribe(client, "jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes()).text
    )


# ---- formats --------------------------------------------------------------------------------------


def test_every_openai_upload_format_gives_the_flacs_text_within_one_wer_point(client):
    clips = [clip for clip in english_clips() if clip.id in ("jfk", "tts_05", "osr72_03")]
    # One file per format holding three clips back to back (24 s), so each format is one request.
    samples = np.concatenate([load_audio_file(clip.path) for clip in clips])
    reference = " ".join(clip.text for clip in clips)
    formats = [FLAC, *UPLOAD_FORMATS]
    with ThreadPoolExecutor(4) as pool:
        texts = list(
            pool.map(
                lambda upload: (
                    _transcribe(client, f"speech.{upload.extension}", encode(samples, upload)).text
                ),
                formats,
            )
        )
    flac_wer = word_error_rate([reference], [texts[0]])
    assert flac_wer < 0.1, texts[0]
    wer_over_the_set = word_error_rate([reference] * (len(formats) - 1), texts[1:])
    assert wer_over_the_set - flac_wer <= 0.01, dict(zip([f.name for f in formats], texts))
    for upload, text in zip(formats[1:], texts[1:]):
        assert word_error_rate([texts[0]], [text]) <= 0.1, (upload.name, text)


# ---- speech detection ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def noise_clips() -> list[NoiseClip]:
    return noise_set()


# Absent: the shipped config's default (http.vad_by_default), speech detection as with "auto".
@pytest.mark.parametrize("strategy", ["auto", None], ids=["auto", "absent"])
def test_with_vad_no_text_comes_from_clips_without_speech(client, noise_clips, strategy):
    silent = [clip for clip in noise_clips if not clip.speech_at_s]
    assert len(silent) >= 6
    for clip in silent:
        verbose = _transcribe(
            client,
            f"{clip.name}.flac",
            encode(clip.samples, FLAC),
            response_format="verbose_json",
            **({"chunking_strategy": strategy} if strategy else {}),
        )
        assert verbose.text == "" and not verbose.segments, (clip.name, verbose.text)
        assert abs(verbose.duration - len(clip.samples) / SAMPLE_RATE) < 0.01


def test_with_vad_inserted_speech_is_transcribed_at_the_time_it_was_inserted(client, noise_clips):
    for clip in [clip for clip in noise_clips if clip.speech_at_s]:
        verbose = _transcribe(
            client,
            f"{clip.name}.flac",
            encode(clip.samples, FLAC),
            response_format="verbose_json",
            chunking_strategy={"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300},
        )
        assert word_error_rate([" ".join(clip.speech_texts)], [verbose.text]) < 0.2, (clip.name, verbose.text)
        for start_s, end_s in clip.speech_at_s:
            inside = [s for s in verbose.segments if start_s - 0.5 <= s.start and s.end <= end_s + 0.5]
            assert inside, (clip.name, start_s, [(s.start, s.end) for s in verbose.segments])
            assert abs(min(s.start for s in inside) - start_s) <= 0.5
            assert abs(max(s.end for s in inside) - end_s) <= 0.5
        assert all(
            any(start_s - 0.5 <= s.start and s.end <= end_s + 0.5 for start_s, end_s in clip.speech_at_s)
            for s in verbose.segments
        ), "no segment outside the inserted speech"


def test_vad_removes_the_words_whisper_writes_into_the_no_speech_clips_without_it(client, noise_clips):
    # Without VAD (chunking_strategy=none: windows cut at quiet points, as before speech detection
    # became the shipped default) Whisper writes words into some of them ("you you" into silence);
    # the count is recorded in benchmarks/RESULTS.md.
    counts = {}
    for clip in [clip for clip in noise_clips if not clip.speech_at_s]:
        counts[clip.name] = len(
            _transcribe(
                client, f"{clip.name}.flac", encode(clip.samples, FLAC), chunking_strategy="none"
            ).text.split()
        )
    print(f"\nwords from the no-speech clips with VAD off: {sum(counts.values())} {counts}")
    assert sum(counts.values()) > 0


@pytest.fixture(scope="module")
def silence() -> bytes:
    return encode(np.zeros(SILENCE_S * SAMPLE_RATE, np.float32), WAV)


def test_45_s_of_digital_silence_is_an_empty_transcript_in_every_format_without_a_chunking_strategy(
    client, silence
):
    """The shipped config detects speech unless asked not to: silence gives "", as OpenAI answers."""
    assert _transcribe(client, "silence.wav", silence).text == ""
    assert _transcribe(client, "silence.wav", silence, response_format="text").strip() == ""
    assert _transcribe(client, "silence.wav", silence, response_format="srt") == ""
    assert _transcribe(client, "silence.wav", silence, response_format="vtt").strip() == "WEBVTT"
    verbose = _transcribe(client, "silence.wav", silence, response_format="verbose_json")
    assert verbose.text == "" and verbose.segments == [] and verbose.duration == SILENCE_S


def test_45_s_of_silence_streams_a_single_done_event_with_empty_text(client, server_url, silence):
    stream = client.audio.transcriptions.create(model="whisper-1", file=("silence.wav", silence), stream=True)
    events = [event.to_dict() for event in stream]
    assert events == [
        {
            "type": "transcript.text.done",
            "text": "",
            "languages": [],
            "usage": {"type": "duration", "seconds": SILENCE_S},
        }
    ]
    # The same as server-sent events on the wire, as curl would see them.
    with httpx.stream(
        "POST",
        f"{server_url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "stream": "true"},
        files={"file": ("silence.wav", silence)},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        wire = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert wire == events


def test_chunking_strategy_sent_as_a_json_string_as_curl_sends_it_is_understood(server_url):
    silence = encode(np.zeros(45 * SAMPLE_RATE, np.float32), WAV)
    for strategy, status in [('{"type": "server_vad", "silence_duration_ms": 500}', 200), ("{not json", 400)]:
        response = httpx.post(
            f"{server_url}/v1/audio/transcriptions",
            data={"model": "whisper-1", "chunking_strategy": strategy, "response_format": "verbose_json"},
            files={"file": ("silence.wav", silence)},
            timeout=120,
        )
        assert response.status_code == status, response.text
        if status == 200:
            assert response.json()["text"] == "" and response.json()["segments"] == []
    assert response.json()["error"]["param"] == "chunking_strategy"


def test_a_bad_chunking_strategy_is_a_400_naming_it(client):
    for strategy in ({"type": "client_vad"}, {"type": "server_vad", "threshold": 3}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as refused:
            _transcribe(
                client, "jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), chunking_strategy=strategy
            )
        assert refused.value.body["param"] == "chunking_strategy"


# ---- broken and overlong files ------------------------------------------------------------------


def _broken_uploads() -> list[tuple[str, str, bytes, int, str]]:
    jfk = load_audio_file(SPEECH_DIR / "jfk.flac")
    mp4 = encode(jfk, UploadFormat("mp4", "mp4", "mp4", "aac", "fltp", 48000))
    return [
        ("truncated-mp4", "clip.mp4", mp4[: len(mp4) // 2], 400, "truncated, corrupt"),
        ("video-only-mp4", "video.mp4", video_only_mp4(), 400, "no audio stream"),
        ("claims-10-hours", "long.flac", flac_claiming(10 * 3600 * SAMPLE_RATE, jfk), 413, "36000 s"),
        (
            "over-limit-unsaid",
            "long.flac",
            flac_claiming(0, np.tile(jfk, 12)),
            413,
            f"runs past {MAX_AUDIO_S} s",
        ),
        ("zip-as-webm", "recording.webm", zip_archive(), 400, "truncated, corrupt"),
    ]


@pytest.mark.parametrize(
    "name, filename, data, status, words", _broken_uploads(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_broken_files_get_a_readable_4xx_and_the_server_answers_the_next_request(
    client, name, filename, data, status, words
):
    with pytest.raises(openai.APIStatusError) as refused:
        _transcribe(client, filename, data)
    assert refused.value.status_code == status
    message = refused.value.body["message"]
    assert words in message and refused.value.body["param"] == "file"
    assert "<" not in message and "BytesIO" not in message and "/" not in message, message
    assert _jfk_answers(client)


# ---- OpenAI parity ------------------------------------------------------------------------------


def test_models_retrieve_gives_served_models_and_openai_404_json_for_others(client, server_url):
    assert client.models.retrieve("whisper-1").id == "whisper-1"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("whisper-9")
    assert missing.value.body["code"] == "model_not_found" and "whisper-9" in missing.value.body["message"]
    unknown = httpx.get(f"{server_url}/v1/nothing/here")
    assert unknown.status_code == 404
    assert set(unknown.json()["error"]) == {"message", "type", "param", "code"}


def test_word_timestamps_with_json_is_a_400_and_with_verbose_json_alone_give_words_not_segments(client):
    jfk = (SPEECH_DIR / "jfk.flac").read_bytes()
    # As OpenAI's API: segment granularity is accepted with json (which has no place for it), word
    # granularity refused.
    segments_asked = _transcribe(
        client, "jfk.flac", jfk, response_format="json", timestamp_granularities=["segment"]
    )
    assert segments_asked.text == _transcribe(client, "jfk.flac", jfk).text
    with pytest.raises(openai.BadRequestError) as refused:
        _transcribe(client, "jfk.flac", jfk, response_format="json", timestamp_granularities=["word"])
    assert refused.value.body["param"] == "timestamp_granularities[]"
    verbose = _transcribe(
        client, "jfk.flac", jfk, response_format="verbose_json", timestamp_granularities=["word"]
    )
    assert [w.word for w in verbose.words] == verbose.text.split()
    assert verbose.segments is None


def test_include_logprobs_gives_each_text_tokens_log_probability(client):
    result = _transcribe(client, "jfk.flac", (SPEECH_DIR / "jfk.flac").read_bytes(), include=["logprobs"])
    assert "".join(item.token for item in result.logprobs).strip() == result.text
    assert all(item.logprob <= 0 for item in result.logprobs)
    assert all(bytes(int(b) for b in item.bytes).decode() == item.token for item in result.logprobs)


def test_a_streamed_verbose_json_gets_each_segment_of_the_verbose_json_as_an_event_after_its_text(client):
    long_file = (SPEECH_DIR / "osr_list72.flac").read_bytes()  # 35.5 s: two windows
    verbose = _transcribe(client, "list72.flac", long_file, response_format="verbose_json")
    events = list(_transcribe(client, "list72.flac", long_file, response_format="verbose_json", stream=True))
    kinds = [event.type for event in events]
    assert kinds[-1] == "transcript.text.done" and kinds.count("transcript.text.done") == 1
    segments = [event for event in events if event.type == "transcript.text.segment"]
    assert [(s.start, s.end, s.text) for s in segments] == [
        (s.start, s.end, s.text) for s in verbose.segments
    ]
    assert len({s.id for s in segments}) == len(segments) >= 2
    # A segment's event comes after the delta that carries its window's text.
    streamed = ""
    for event in events[:-1]:
        if event.type == "transcript.text.delta":
            streamed += event.delta
        else:
            assert event.text.strip() in streamed
    assert streamed == events[-1].text == verbose.text


def test_a_streamed_include_logprobs_puts_each_deltas_on_it_and_all_of_them_on_done(client):
    long_file = (SPEECH_DIR / "osr_list72.flac").read_bytes()
    whole = _transcribe(client, "list72.flac", long_file, include=["logprobs"])
    events = list(_transcribe(client, "list72.flac", long_file, include=["logprobs"], stream=True))
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 2 and all(event.type == "transcript.text.delta" for event in deltas)
    for delta in deltas:
        assert "".join(item.token for item in delta.logprobs).strip() == delta.delta.strip()
    assert [item.token for item in done.logprobs] == [item.token for item in whole.logprobs]
    assert [item.logprob for item in done.logprobs] == pytest.approx(
        [item.logprob for item in whole.logprobs], abs=0.05
    )
    assert [item.token for delta in deltas for item in delta.logprobs] == [
        item.token for item in done.logprobs
    ]


# ---- usage --------------------------------------------------------------------------------------


def test_usage_is_the_audios_seconds_in_json_verbose_json_and_the_streams_done_event(client):
    jfk = (SPEECH_DIR / "jfk.flac").read_bytes()
    duration_s = len(load_audio_file(SPEECH_DIR / "jfk.flac")) / SAMPLE_RATE
    usages = {
        "json": _transcribe(client, "jfk.flac", jfk).usage,
        "json-logprobs": _transcribe(client, "jfk.flac", jfk, include=["logprobs"]).usage,
        "verbose_json": _transcribe(client, "jfk.flac", jfk, response_format="verbose_json").usage,
        "stream": list(_transcribe(client, "jfk.flac", jfk, stream=True))[-1].usage,
    }
    for name, usage in usages.items():
        assert usage.type == "duration" and abs(usage.seconds - duration_s) < 0.1, (name, usage)


def test_the_audio_seconds_counter_grows_by_each_answered_requests_seconds_for_its_model(client, server_url):
    jfk = (SPEECH_DIR / "jfk.flac").read_bytes()
    duration_s = len(load_audio_file(SPEECH_DIR / "jfk.flac")) / SAMPLE_RATE

    def billed_s(model: str) -> float:
        # No API keys on this server: every request is billed to the anonymous label.
        return labelled_sum(server_url, "whisper_audio_seconds_total", model=model, api_key="anonymous")

    before = billed_s("tiny.en")
    _transcribe(client, "jfk.flac", jfk)  # whisper-1: tiny.en's alias, billed to the model that served it
    client.audio.transcriptions.create(
        model="tiny.en", file=("jfk.flac", jfk), response_format="verbose_json"
    )
    with pytest.raises(openai.BadRequestError):  # refused: nothing transcribed, nothing billed
        _transcribe(client, "jfk.flac", jfk, timestamp_granularities=["word"])
    assert billed_s("tiny.en") - before == pytest.approx(2 * duration_s, abs=0.2)
    assert billed_s("whisper-1") == 0, "an alias is no label of its own"
