"""Several models in one app: the shipped configs/default.yaml (the bundled tiny.en, its default and
`whisper-1`, and the multilingual base, each with an encoder and a decoder deployment of its own) on
a real local Ray and Serve, spoken to with the official openai client. Requests and realtime sessions
choose a model by name; each model answers with its own offline text, translates if it can, and
keeps answering while the other model's replica is lost.

Every test of two models is here, on one app: each model costs the app start-up time.
"""

from __future__ import annotations

import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jiwer
import numpy as np
import openai
import pytest
import soundfile

from deployments.config import parse_app_config
from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.model.loading import load_model
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions, FallbackOptions
from tests.support.app_metrics import metric_sum
from tests.support.live_stream import REALTIME_RATE_HZ, stream_live, to_pcm16_24k, transcription_session
from tests.support.serving import replica_actor, running_app, shipped_default_args
from tests.support.speech import SPEECH_DIR, wav_bytes

pytestmark = pytest.mark.ray

# The multilingual clip: English for its first 30 s, German after. Both stretches end at a pause.
MIXED = load_audio_file(SPEECH_DIR / "multilingual.flac")
ENGLISH = MIXED[: int(9.0 * SAMPLE_RATE)]  # "Permission is hereby granted, ... without restriction,"
GERMAN = MIXED[int(30.0 * SAMPLE_RATE) : int(42.3 * SAMPLE_RATE)]  # "Jeden, der diese Software ..."
READY_WITHIN_S = 300


@pytest.fixture(scope="module")
def server_url():
    started = time.monotonic()
    with running_app(shipped_default_args()) as url:
        while (probe := httpx.get(f"{url}/ready", timeout=30)).status_code != 200:
            assert time.monotonic() - started < READY_WITHIN_S, probe.json()
            time.sleep(0.5)
        print(f"\ntwo-model app: / ready {time.monotonic() - started:.1f} s after the start")
        yield url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("multilingual")
    paths = {}
    for name, samples in (("english", ENGLISH), ("german", GERMAN)):
        paths[name] = str(folder / f"{name}.wav")
        with open(paths[name], "wb") as out:
            out.write(wav_bytes(samples))
    return paths


@functools.cache
def _offline(model_name: str) -> Transcriber:
    """The offline API with the engine settings the shipped config gives ``model_name``."""
    engine = parse_app_config(shipped_default_args()).model_named(model_name).engine
    return Transcriber(loaded=load_model(engine))


def _transcribe(client: openai.OpenAI, model: str, path: str, **kwargs) -> str:
    """The file endpoint's text, on the windows the offline API cuts (no speech detection, which the
    shipped config applies to requests that name no chunking_strategy)."""
    with open(path, "rb") as audio:
        return client.audio.transcriptions.create(
            model=model, file=audio, chunking_strategy="none", **kwargs
        ).text


API_DEFAULTS = DecodeOptions(fallback=FallbackOptions())  # temperature 0 with openai-whisper's fallback


def test_the_same_clip_through_each_model_gets_that_models_own_offline_text(client, clips):
    for model in ("tiny.en", "base"):
        expected = _offline(model).transcribe([clips["german"], clips["english"]], API_DEFAULTS)
        assert _transcribe(client, model, clips["german"]) == expected[0].text, model
        assert _transcribe(client, model, clips["english"]) == expected[1].text, model
    german_on_tiny, german_on_base = (_transcribe(client, m, clips["german"]) for m in ("tiny.en", "base"))
    assert german_on_tiny != german_on_base and "Software" in german_on_base
    assert _transcribe(client, "whisper-1", clips["german"]) == german_on_tiny, "the alias is tiny.en"


def test_a_translation_on_base_is_its_offline_english_and_on_english_only_tiny_en_a_400(client, clips):
    with open(clips["german"], "rb") as audio:
        translation = client.audio.translations.create(
            model="base", file=audio, extra_body={"chunking_strategy": "none"}
        ).text
    expected = _offline("base").transcribe(
        [clips["german"]], DecodeOptions(task="translate", fallback=FallbackOptions())
    )
    assert translation == expected[0].text and "software" in translation.lower()
    assert "der" not in translation.split()
    for model in ("tiny.en", "whisper-1"):
        with pytest.raises(openai.BadRequestError) as refused, open(clips["german"], "rb") as audio:
            client.audio.translations.create(model=model, file=audio)
        error = refused.value.response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
        assert "'tiny.en' is English-only" in error["message"] and "multilingual" in error["message"]


def test_an_unknown_model_is_a_404_in_openais_error_json_naming_the_models_in_words(
    client, server_url, clips
):
    with pytest.raises(openai.NotFoundError) as missing, open(clips["english"], "rb") as audio:
        client.audio.transcriptions.create(model="whisper-9", file=audio)
    body = missing.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert error["message"] == (
        "The model 'whisper-9' does not exist; this server serves tiny.en, whisper-1, base."
    )
    retrieved = httpx.get(f"{server_url}/v1/models/whisper-9", timeout=30)
    assert retrieved.status_code == 404 and retrieved.json() == body


def test_languages_on_base_make_the_transcripts_language_one_of_them_in_every_shape(
    client, server_url, clips
):
    """The multilingual clip's English stretch, asked to be German or French: verbose_json's
    language, json's languages and the stream's are among them, where base finds English unasked."""
    asked = ["de", "fr"]
    with open(clips["english"], "rb") as audio:
        verbose = client.audio.transcriptions.create(
            model="base", file=audio, languages=asked, response_format="verbose_json"
        )
    assert verbose.language in asked
    with open(clips["english"], "rb") as audio:
        free = client.audio.transcriptions.create(model="base", file=audio)
    with open(clips["english"], "rb") as audio:
        restricted = client.audio.transcriptions.create(model="base", file=audio, languages=asked)
    assert [language.code for language in free.languages] == ["en"]
    assert restricted.languages and {language.code for language in restricted.languages} <= set(asked)
    with open(clips["english"], "rb") as audio:
        events = list(
            client.audio.transcriptions.create(model="base", file=audio, languages=asked, stream=True)
        )
    assert events[-1].type == "transcript.text.done"
    assert events[-1].languages and {language.code for language in events[-1].languages} <= set(asked)
    # Spelled without brackets, as a form may send it, the list is read alike.
    with open(clips["english"], "rb") as audio:
        response = httpx.post(
            f"{server_url}/v1/audio/transcriptions",
            data={"model": "base", "languages": ["de", "xx"]},
            files={"file": audio},
            timeout=300,
        )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "languages" and "'xx'" in error["message"]


@pytest.mark.parametrize(
    "model, fields, param, words",
    [
        ("base", {"languages": ["de", "xx"]}, "languages", "not 'xx'"),
        ("tiny.en", {"languages": ["de", "fr"]}, "languages", "English-only"),
        ("base", {"language": "it", "languages": ["de", "fr"]}, "language", "not among languages ('de, fr')"),
    ],
    ids=["unknown-code", "english-only-without-en", "language-not-among-them"],
)
def test_languages_a_model_cannot_decode_in_are_a_400_naming_the_field(
    client, clips, model, fields, param, words
):
    with pytest.raises(openai.BadRequestError) as refused, open(clips["english"], "rb") as audio:
        client.audio.transcriptions.create(model=model, file=audio, **fields)
    error = refused.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def _keyword_clip() -> dict:
    lines = (SPEECH_DIR / "keyword_manifest.jsonl").read_text().splitlines()
    return next(clip for clip in map(json.loads, lines) if clip["id"] == "kw_siobhan")


def test_keywords_make_whisper_1_spell_a_rare_name_as_given(client):
    """The clip says "Shivawn" (as the name sounds); with the keyword the text spells it Siobhan."""
    clip = _keyword_clip()
    path = str(SPEECH_DIR / clip["audio"])
    plain = _transcribe(client, "whisper-1", path)
    guided = _transcribe(client, "whisper-1", path, keywords=clip["keywords"])
    assert "Siobhan" not in plain and "Siobhan" in guided, (plain, guided)


def test_keywords_over_the_prompts_budget_are_a_400_in_words_naming_keywords(client):
    clip = _keyword_clip()
    too_many = [f"Name{number}" for number in range(100)]  # some 300 tokens
    with pytest.raises(openai.BadRequestError) as refused, open(SPEECH_DIR / clip["audio"], "rb") as audio:
        client.audio.transcriptions.create(model="whisper-1", file=audio, keywords=too_many)
    body = refused.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "keywords"
    assert error["message"].startswith("keywords take") and "fewer or shorter keywords" in error["message"]
    assert not any(mark in error["message"] for mark in "[]()'\"")


def test_the_models_route_lists_every_model_and_alias_as_openais_list(client):
    listed = client.models.list()
    assert [model.id for model in listed.data] == ["tiny.en", "whisper-1", "base"]
    assert all(model.object == "model" for model in listed.data)
    assert client.models.retrieve("base").id == "base"


def test_ready_says_which_models_are_ready_and_answers_for_one_model_when_asked(server_url):
    ready = httpx.get(f"{server_url}/ready", timeout=30).json()
    assert ready["status"] == "ready" and set(ready["models"]) == {"tiny.en", "base"}
    assert all(state["ready"] and state["warm_up_s"] > 0 for state in ready["models"].values())
    one = httpx.get(f"{server_url}/ready", params={"model": "whisper-1"}, timeout=30).json()
    assert set(one["models"]) == {"tiny.en"}
    unknown = httpx.get(f"{server_url}/ready", params={"model": "whisper-9"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_metrics_label_requests_and_replicas_by_model(client, server_url, clips):
    for model in ("tiny.en", "base", "whisper-9"):
        try:
            _transcribe(client, model, clips["english"])
        except openai.NotFoundError:
            assert model == "whisper-9"
    text = httpx.get(f"{server_url}/metrics", timeout=30).text
    for model in ("tiny.en", "base"):
        assert f'whisper_requests_total{{model="{model}",route="transcriptions",status="200"}}' in text
        tokens = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(f'whisper_decoder_tokens_generated{{model="{model}",')
        ]
        assert len(tokens) == 1 and tokens[0] > 0, (model, tokens)
        staged = (
            f'whisper_transfer_info{{connector="nixl",model="{model}",payload="cross_kv",replica="0"}} 1.0'
        )
        assert staged in text
    assert 'whisper_requests_total{model="",route="transcriptions",status="404"}' in text, (
        "never a made-up name"
    )
    assert metric_sum(server_url, "whisper_decoder_kv_blocks_used") == 0, "both models' pools are free"


def _words_apart(live_text: str, file_text: str) -> int:
    reference = file_text.lower().split()
    return round(jiwer.wer(" ".join(reference), live_text.lower()) * len(reference))


def test_a_realtime_session_on_base_transcribes_english_and_german_turns_as_its_file_endpoint(
    client, tmp_path
):
    with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
        assert json.loads(connection.recv_bytes())["type"] == "session.created"
        unknown = {"type": "transcription", "audio": {"input": {"transcription": {"model": "gpt-9"}}}}
        connection.send_raw(json.dumps({"type": "session.update", "session": unknown}))
        refused = json.loads(connection.recv_bytes())
        assert refused["error"]["code"] == "model_not_found" and "[" not in refused["error"]["message"]
        connection.session.update(session=transcription_session(None, transcription={"model": "base"}))
        updated = json.loads(connection.recv_bytes())
        assert updated["session"]["audio"]["input"]["transcription"]["model"] == "base"
        turns = [to_pcm16_24k(ENGLISH), to_pcm16_24k(GERMAN)]
        record = stream_live(connection, turns, silence_s=0.5, commit=True, lead_silence_s=0.2)
    live = [turn["text"] for turn in record.turns()]
    file_texts = []
    for index, pcm16 in enumerate(turns):  # each turn's audio exactly as the stream sent it
        path = tmp_path / f"turn{index}.wav"
        soundfile.write(path, np.frombuffer(pcm16, dtype="<i2"), REALTIME_RATE_HZ, subtype="PCM_16")
        file_texts.append(_transcribe(client, "base", str(path)))
    assert len(live) == 2 and "Permission" in live[0] and "Software" in live[1] and "der" in live[1].split()
    for live_text, file_text in zip(live, file_texts):
        assert _words_apart(live_text, file_text) <= 2, (live_text, file_text)


def test_losing_one_models_decoder_leaves_the_other_answering_and_serve_brings_it_back(client, clips):
    import ray

    tiny_text = _transcribe(client, "tiny.en", clips["english"])
    ray.kill(replica_actor("WhisperDecoder-base"), no_restart=True)
    with ThreadPoolExecutor(4) as pool:  # while base's decoder is gone or restarting
        texts = list(pool.map(lambda _: _transcribe(client, "tiny.en", clips["english"]), range(8)))
    assert texts == [tiny_text] * 8
    deadline = time.monotonic() + 180
    while True:  # Serve replaces the lost replica; base answers again
        try:
            assert "Software" in _transcribe(client, "base", clips["german"])
            break
        except openai.APIStatusError as error:
            assert error.status_code == 503, error.response.text
            assert time.monotonic() < deadline, "base never came back"
            time.sleep(1)
