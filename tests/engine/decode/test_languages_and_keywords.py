"""DecodeOptions' ``languages`` (detection chooses among them) and ``keywords`` (terms put before
the previous text, as faster-whisper's hotwords), on the bundled tiny.en and base."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.decode.prompt import build_prompt
from engine.encode.runner import EncoderRunner
from engine.errors import QUOTED_CHARS, RequestRejectedError
from engine.kv.sources import CrossKVTensor
from engine.model.audio import N_SAMPLES, load_audio_file, pad_or_trim
from engine.model.loading import load_model
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions
from tests.support.engines import run_to_completion_by_id
from tests.support.speech import SPEECH_DIR


@pytest.fixture(scope="module")
def base():
    return load_model(EngineConfig(model="base"))


@pytest.fixture(scope="module")
def german_window() -> np.ndarray:
    """The German half of the multilingual clip: base detects it as German when free to."""
    return pad_or_trim(load_audio_file(SPEECH_DIR / "multilingual.flac")[N_SAMPLES:])


@pytest.fixture(scope="module")
def keyword_clip() -> dict:
    """A sentence with a rare name, spoken as it sounds ("Shivawn"); its text spells it "Siobhan"."""
    lines = (SPEECH_DIR / "keyword_manifest.jsonl").read_text().splitlines()
    return next(clip for clip in map(json.loads, lines) if clip["id"] == "kw_siobhan")


def test_detection_chooses_only_among_each_requests_languages_in_one_batch_translations_too(
    base, german_window
):
    encoder = EncoderRunner(base)
    engine = DecoderEngine(base)
    cross_kv = encoder.cross_kv(encoder.encode(german_window[None]))[0]
    asked = {
        "free": DecodeOptions(max_tokens=8),
        "en-fr": DecodeOptions(languages=("en", "fr"), max_tokens=8),
        "es-fr": DecodeOptions(languages=("es", "fr"), max_tokens=8),
        "translated-es-fr": DecodeOptions(task="translate", languages=("es", "fr"), max_tokens=8),
    }
    for request_id, options in asked.items():
        engine.submit(engine.make_request(options, CrossKVTensor(cross_kv), request_id=request_id))
    results = run_to_completion_by_id(engine)
    assert results["free"].language == "de"
    assert results["en-fr"].language in ("en", "fr")
    assert results["es-fr"].language in ("es", "fr")
    assert results["translated-es-fr"].language in ("es", "fr")


def test_one_language_is_decoded_in_without_detection(base):
    prompt = build_prompt(base.tokenizer, base.weights.dims, DecodeOptions(languages=("fr",)))
    assert not prompt.detect_language and prompt.language == "fr"
    assert prompt.tokens[prompt.sot_index + 1] == base.tokenizer.language_tokens["fr"]


def test_language_with_languages_is_decoded_in_and_must_be_among_them(base):
    prompt = build_prompt(
        base.tokenizer, base.weights.dims, DecodeOptions(language="fr", languages=("de", "fr"))
    )
    assert not prompt.detect_language and prompt.language == "fr"
    with pytest.raises(RequestRejectedError, match="not among languages") as rejected:
        build_prompt(base.tokenizer, base.weights.dims, DecodeOptions(language="it", languages=("de", "fr")))
    assert rejected.value.param == "language"


@pytest.mark.parametrize(
    "languages, words",
    [(("de", "xx"), "language codes this model knows; not 'xx'"), ((), "at least one language")],
    ids=["unknown-code", "empty"],
)
def test_languages_the_model_does_not_know_are_rejected(base, languages, words):
    with pytest.raises(RequestRejectedError, match=words) as rejected:
        build_prompt(base.tokenizer, base.weights.dims, DecodeOptions(languages=languages))
    assert rejected.value.param == "languages"


def test_english_only_models_take_languages_that_include_english(tiny_en):
    prompt = build_prompt(tiny_en.tokenizer, tiny_en.weights.dims, DecodeOptions(languages=("de", "en")))
    assert prompt.language == "en" and not prompt.detect_language
    with pytest.raises(RequestRejectedError, match="English-only") as rejected:
        build_prompt(tiny_en.tokenizer, tiny_en.weights.dims, DecodeOptions(languages=("de", "fr")))
    assert rejected.value.param == "languages"


def test_keywords_come_before_the_previous_text_which_keeps_its_most_recent_tokens(tiny_en):
    tokenizer, dims = tiny_en.tokenizer, tiny_en.weights.dims
    budget = dims.n_text_ctx // 2 - 1
    keywords = tokenizer.encode(" Siobhan, Tadhg O'Sullivan")
    previous = list(range(1000, 1000 + budget))  # a whole budget of previous text
    prompt = build_prompt(
        tokenizer, dims, DecodeOptions(keywords=("Siobhan", " Tadhg O'Sullivan "), prompt=tuple(previous))
    )
    kept = budget - len(keywords)
    assert prompt.tokens[: prompt.sot_index] == [tokenizer.special.sot_prev, *keywords, *previous[-kept:]]


def test_keywords_alone_over_the_prompts_budget_are_rejected_in_words(tiny_en):
    tokenizer, dims = tiny_en.tokenizer, tiny_en.weights.dims
    budget = dims.n_text_ctx // 2 - 1
    fits = ("word " * (budget - 1)).strip()  # " word" is one token; the leading space makes it so
    assert len(build_prompt(tokenizer, dims, DecodeOptions(keywords=(fits,))).tokens) > budget
    with pytest.raises(RequestRejectedError) as rejected:
        build_prompt(tokenizer, dims, DecodeOptions(keywords=(fits, "Siobhan")))
    assert rejected.value.param == "keywords"
    assert str(rejected.value).startswith("keywords take") and "(" not in str(rejected.value)


def test_keywords_change_a_rare_names_spelling_to_theirs(tiny_en, keyword_clip):
    audio = SPEECH_DIR / keyword_clip["audio"]
    transcriber = Transcriber(loaded=tiny_en)
    plain = transcriber.transcribe([audio], DecodeOptions())[0].text
    guided = transcriber.transcribe([audio], DecodeOptions(keywords=tuple(keyword_clip["keywords"])))[0].text
    assert "Siobhan" not in plain and "Siobhan" in guided, (plain, guided)


@pytest.mark.slow
def test_every_long_form_window_detects_among_the_languages(base):
    """The multilingual clip (English, then German) asked to be English or French: each window's
    language, and the transcript's, is one of the two, where free detection finds German."""
    transcriber = Transcriber(loaded=base)
    audio = SPEECH_DIR / "multilingual.flac"
    free = transcriber.transcribe([audio], DecodeOptions(max_tokens=8))[0]
    asked = transcriber.transcribe([audio], DecodeOptions(languages=("en", "fr"), max_tokens=8))[0]
    assert "de" in free.languages and len(asked.windows) == len(free.windows) > 1
    assert {window.language for window in asked.windows} <= {"en", "fr"}
    assert asked.language in ("en", "fr") and set(asked.languages) <= {"en", "fr"}


def test_a_huge_language_value_is_quoted_cut_short_in_the_rejection(base):
    huge = "k" * 10_000
    with pytest.raises(RequestRejectedError) as rejected:
        build_prompt(base.tokenizer, base.weights.dims, DecodeOptions(language=huge))
    message = str(rejected.value)
    assert "k" * QUOTED_CHARS in message and "k" * (QUOTED_CHARS + 1) not in message
    assert "10000 characters" in message
