"""Greedy decoding through our paged engine gives transformers' tokens, token for token."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVTensor
from engine.model.audio import N_SAMPLES, load_audio_file, log_mel_spectrogram
from engine.model.loading import load_model
from engine.types import DecodeOptions
from tests.support.engines import decode_alone, engine_with, run_to_completion_by_id
from tests.support.hf_reference import hf_greedy_as_engine, hf_model
from tests.support.speech import SPEECH_DIR, short_english_clips, windows_of


@pytest.fixture(scope="module")
def random_setup(random_whisper_folder):
    loaded = load_model(
        EngineConfig(model=str(random_whisper_folder), dtype="float32", block_size=8, kv_cache_memory_mb=64)
    )
    reference, _ = hf_model(str(random_whisper_folder))
    return loaded, reference


PROMPT_CASES = [
    pytest.param(DecodeOptions(max_tokens=3), id="three-tokens"),
    pytest.param(DecodeOptions(max_tokens=40), id="forty-tokens"),
    pytest.param(
        DecodeOptions(max_tokens=25, prompt="the previous window said hello there"), id="previous-text"
    ),
    pytest.param(DecodeOptions(max_tokens=30, timestamps=True), id="timestamps"),
]


@pytest.mark.parametrize(
    "stepped_prompt_tokens", [0, 64], ids=["prompt-in-one-step", "prompt-a-token-a-step"]
)
@pytest.mark.parametrize("options", PROMPT_CASES)
def test_random_small_whisper_decodes_the_same_tokens_as_transformers(
    random_setup, options, stepped_prompt_tokens
):
    loaded, reference = random_setup
    engine = engine_with(loaded, stepped_prompt_tokens=stepped_prompt_tokens)
    audio = windows_of([SPEECH_DIR / "jfk.flac"])
    encoder = EncoderRunner(loaded)
    with torch.inference_mode():
        mels = log_mel_spectrogram(audio, loaded.weights.dims.n_mels)
        cross_kv = encoder.cross_kv(loaded.model.encoder(mels))[0]
    request, result = decode_alone(engine, cross_kv, options)
    expected = hf_greedy_as_engine(reference, mels, engine, request)
    assert len(result.tokens) > 0
    assert result.tokens == expected


@pytest.mark.slow
def test_bundled_tiny_en_matches_transformers_on_the_speech_set(tiny_en, short_clip_cross_kvs):
    """End to end on real speech: our audio front end and engine vs WhisperFeatureExtractor and
    transformers' model with the same weights. A clip may differ only where the two front ends'
    log-mels (max difference <= 1e-3) or summation order flip a near-tie; we allow 5% of clips.
    Our encoder's states of the set are computed once per test run (tests/conftest.py), and the
    engine decodes the clips together, in one continuous batch, as it serves them."""
    from transformers import WhisperFeatureExtractor

    reference, _ = hf_model("tiny.en")
    extractor = WhisperFeatureExtractor(feature_size=tiny_en.weights.dims.n_mels)
    engine = DecoderEngine(tiny_en)
    clips = short_english_clips()
    requests = [engine.make_request(DecodeOptions(), CrossKVTensor(kv)) for kv in short_clip_cross_kvs(clips)]
    for request in requests:
        engine.submit(request)
    results = run_to_completion_by_id(engine)
    assert engine.pool.num_used_blocks == 0
    mismatches = []
    for clip, request in zip(clips, requests, strict=True):
        result = results[request.request_id]
        samples = load_audio_file(clip.path)
        features = torch.from_numpy(
            extractor(samples[:N_SAMPLES], sampling_rate=16000, return_tensors="np").input_features
        )
        expected = hf_greedy_as_engine(reference, features, engine, request)
        if result.tokens != expected:
            mismatches.append((clip.id, result.text, tiny_en.tokenizer.decode(expected)))
    print(f"tiny.en token-exact with transformers on {len(clips) - len(mismatches)}/{len(clips)} clips")
    assert len(clips) >= 40
    assert len(mismatches) <= 0.05 * len(clips), mismatches
