"""Temperature fallback inside the decoder engine, as openai-whisper's transcribe does it: a window
whose text fails the thresholds is decoded again at the next temperature, on the same blocks and
cross-attention K/V (no second encode), and reports the temperature it was decoded at."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.decode.fallback import compression_ratio
from engine.kv.sources import CrossKVTensor
from engine.model.loading import load_model
from engine.types import DecodeOptions, FallbackOptions
from tests.support.engines import cross_kv_of, decode_one
from tests.support.speech import SPEECH_DIR


@dataclass
class CountedLoads:
    """A window's K/V that counts how often the engine loads it into blocks."""

    kv: CrossKVTensor
    loads: int = 0
    travels = False

    @property
    def num_frames(self) -> int:
        return self.kv.num_frames

    def load_into(self, storage, block_ids, project_states):
        self.loads += 1
        self.kv.load_into(storage, block_ids, project_states)


def decode(engine: DecoderEngine, cross_kv: torch.Tensor, options: DecodeOptions):
    source = CountedLoads(CrossKVTensor(cross_kv))
    request, result = decode_one(engine, source, options)
    return request, result, source.loads


@pytest.fixture(scope="module")
def jfk_kv(tiny_en) -> torch.Tensor:
    return cross_kv_of(tiny_en, SPEECH_DIR / "jfk.flac")


def test_a_window_that_passes_the_thresholds_decodes_exactly_as_without_fallback(tiny_en, jfk_kv):
    engine = DecoderEngine(tiny_en)
    _, plain, _ = decode(engine, jfk_kv, DecodeOptions())
    _, guarded, loads = decode(engine, jfk_kv, DecodeOptions(fallback=FallbackOptions()))
    assert guarded.tokens == plain.tokens and guarded.temperature == 0.0 and loads == 1
    assert guarded.avg_logprob > -1.0 and guarded.compression_ratio == compression_ratio(guarded.text) < 2.4


def test_a_window_that_always_fails_is_tried_at_every_temperature_on_the_same_blocks(tiny_en, jfk_kv):
    engine = DecoderEngine(tiny_en)
    never_sure = FallbackOptions(logprob_threshold=0.0, no_speech_threshold=None)  # every text fails
    request, result, loads = decode(engine, jfk_kv, DecodeOptions(fallback=never_sure, seed=3, max_tokens=12))
    assert request.attempt == 5 and result.temperature == 1.0
    assert loads == 1, "the cross-attention K/V was loaded once and kept for every attempt"
    assert engine.pool.num_used_blocks == 0 and engine.pool.num_free_blocks == engine.pool.num_blocks
    assert result.text.strip(), "the last attempt's text is returned"


@pytest.mark.slow
def test_a_window_just_below_the_threshold_is_retried_until_an_attempt_passes(tiny_en, jfk_kv):
    engine = DecoderEngine(tiny_en)
    _, greedy, _ = decode(engine, jfk_kv, DecodeOptions())
    strict = FallbackOptions(logprob_threshold=greedy.avg_logprob + 1e-6, no_speech_threshold=None)
    _, result, loads = decode(engine, jfk_kv, DecodeOptions(fallback=strict, seed=0, max_tokens=40))
    assert result.temperature > 0.0 and loads == 1
    assert result.avg_logprob >= strict.logprob_threshold or result.temperature == 1.0
    assert engine.pool.num_used_blocks == 0


def test_a_random_model_repeating_itself_falls_back_and_reports_the_hotter_temperature(random_whisper_folder):
    loaded = load_model(
        EngineConfig(model=str(random_whisper_folder), dtype="float32", block_size=8, kv_cache_memory_mb=64)
    )
    engine = DecoderEngine(loaded)
    kv = cross_kv_of(loaded, SPEECH_DIR / "jfk.flac")
    _, greedy, _ = decode(engine, kv, DecodeOptions(max_tokens=60))
    assert greedy.compression_ratio > 2.4, "random weights repeat a token: the case fallback is for"
    _, result, _ = decode(engine, kv, DecodeOptions(max_tokens=60, fallback=FallbackOptions(), seed=1))
    assert result.temperature > 0.0
    assert engine.pool.num_used_blocks == 0


def test_silence_is_judged_no_speech_and_returns_no_text_without_retrying(tiny_en):
    """On near-silence tiny.en is sure of <|nospeech|> (p 0.94) and says " you" (log-probability
    -0.57): with the log-probability threshold above that, openai-whisper's rule calls the window
    silence, which is neither retried nor transcribed."""
    engine = DecoderEngine(tiny_en)
    rng = np.random.default_rng(0)
    hiss = (1e-4 * rng.standard_normal(16000 * 10)).astype(np.float32)
    kv = cross_kv_of(tiny_en, hiss)
    _, heard, _ = decode(engine, kv, DecodeOptions(fallback=FallbackOptions()))
    assert (
        heard.no_speech_prob > 0.6 and heard.avg_logprob > -1.0 and heard.text.strip() and not heard.no_speech
    )
    _, result, _ = decode(
        engine, kv, DecodeOptions(fallback=FallbackOptions(logprob_threshold=heard.avg_logprob + 0.1))
    )
    assert result.no_speech and result.text == "" and result.tokens == [] and result.temperature == 0.0


@pytest.mark.slow
def test_fallback_from_greedy_is_reproducible_without_a_seed(tiny_en, jfk_kv):
    """The same transcript on every run and replica (offline and over HTTP alike)."""
    engine = DecoderEngine(tiny_en)
    never_sure = DecodeOptions(
        fallback=FallbackOptions(logprob_threshold=0.0, no_speech_threshold=None), max_tokens=10
    )
    first, second = (decode(engine, jfk_kv, never_sure)[1] for _ in range(2))
    assert first.temperature == second.temperature == 1.0 and first.tokens == second.tokens
