"""Multilingual Whisper (bundled base): language detection, transcription in the detected
language, and translation to English; and the same plumbing on a small random multilingual model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.encode.runner import EncoderRunner
from engine.errors import RequestRejectedError
from engine.kv.sources import CrossKVTensor
from engine.model.audio import N_SAMPLES, load_audio_file, log_mel_spectrogram, pad_or_trim
from engine.model.loading import load_model
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions
from tests.support.engines import run_to_completion
from tests.support.hf_reference import hf_greedy_as_engine, hf_model
from tests.support.remembered_states import RememberedStates
from tests.support.speech import SPEECH_DIR
from tests.support.threads import reference_threads


@pytest.fixture(scope="module")
def base():
    return load_model(EngineConfig(model="base", dtype="float32"))


@pytest.fixture(scope="module")
def base_states() -> RememberedStates:
    """base's encoder states of the windows below, each encoded once for the tests here that
    decode it (tests/support/remembered_states.py)."""
    return RememberedStates()


@pytest.fixture(scope="module")
def base_reference():
    return hf_model("base")[0]


@pytest.fixture(scope="module")
def windows() -> dict[str, np.ndarray]:
    """Three windows: JFK (English), the English and the German halves of the multilingual clip."""
    mixed = load_audio_file(SPEECH_DIR / "multilingual.flac")
    return {
        "jfk": pad_or_trim(load_audio_file(SPEECH_DIR / "jfk.flac")),
        "mixed_english": pad_or_trim(mixed[:N_SAMPLES]),
        "mixed_german": pad_or_trim(mixed[N_SAMPLES:]),
    }


@pytest.mark.slow
def test_language_is_detected_per_window_as_faster_whisper_detects_it(base, base_states, windows):
    from faster_whisper import WhisperModel

    reference = WhisperModel(
        str(base.weights.folder), device="cpu", compute_type="float32", cpu_threads=reference_threads()
    )
    transcriber = base_states.given_to(Transcriber(loaded=base))
    results = transcriber.transcribe(list(windows.values()), DecodeOptions(max_tokens=20))
    ours = [result.language for result in results]
    theirs = [reference.detect_language(window)[0] for window in windows.values()]
    assert ours == theirs == ["en", "en", "de"]


@pytest.mark.slow
def test_translate_turns_german_speech_into_english_text(base, base_states, windows):
    german = windows["mixed_german"]
    transcribers = [base_states.given_to(Transcriber(loaded=base)) for _ in range(2)]
    transcript = transcribers[0].transcribe([german], DecodeOptions(language="de"))[0].text
    translation = transcribers[1].transcribe([german], DecodeOptions(task="translate"))[0].text
    assert "Software" in transcript and "der" in transcript.split()
    assert "software" in translation.lower() and "der" not in translation.split()


@pytest.mark.slow
@pytest.mark.parametrize(
    "language, task, window",
    [("en", "transcribe", "jfk"), ("de", "transcribe", "mixed_german"), ("de", "translate", "mixed_german")],
)
def test_multilingual_prompts_decode_the_same_tokens_as_transformers(
    base, base_states, base_reference, windows, language, task, window
):
    engine = DecoderEngine(base)
    encoder = EncoderRunner(base)
    audio = torch.from_numpy(windows[window])[None]
    states = base_states.states_of([windows[window]], encoder.encode)
    request = engine.make_request(
        DecodeOptions(language=language, task=task, max_tokens=60), CrossKVTensor(encoder.cross_kv(states)[0])
    )
    engine.submit(request)
    results = run_to_completion(engine)
    expected = hf_greedy_as_engine(base_reference, log_mel_spectrogram(audio, 80), engine, request)
    assert results[0].tokens == expected and engine.pool.num_used_blocks == 0


def test_english_only_models_refuse_other_languages_and_translation(tiny_en):
    engine = DecoderEngine(tiny_en)
    with pytest.raises(RequestRejectedError, match="English-only"):
        engine.make_request(DecodeOptions(language="de"), None)
    with pytest.raises(RequestRejectedError, match="English-only"):
        engine.make_request(DecodeOptions(task="translate"), None)


@pytest.mark.parametrize("stepped_prompt_tokens", [0, 8], ids=["prompt-in-one-step", "prompt-a-token-a-step"])
@pytest.mark.parametrize(
    "language, task", [(None, "transcribe"), ("de", "translate")], ids=["detect", "translate"]
)
def test_a_random_multilingual_model_detects_the_language_transformers_ranks_first_and_decodes_its_tokens(
    random_multilingual_whisper_folder, language, task, stepped_prompt_tokens
):
    loaded = load_model(
        EngineConfig(
            model=str(random_multilingual_whisper_folder),
            dtype="float32",
            block_size=8,
            kv_cache_memory_mb=64,
            gpu={"stepped_prompt_tokens": stepped_prompt_tokens},
        )
    )
    reference, _ = hf_model(str(random_multilingual_whisper_folder))
    tokenizer = loaded.tokenizer
    audio = torch.from_numpy(pad_or_trim(load_audio_file(SPEECH_DIR / "jfk.flac")))[None]
    encoder = EncoderRunner(loaded)
    engine = DecoderEngine(loaded)
    mels = log_mel_spectrogram(audio, 80)
    request = engine.make_request(
        DecodeOptions(language=language, task=task, max_tokens=12),
        CrossKVTensor(encoder.cross_kv(encoder.encode(audio))[0]),
    )
    engine.submit(request)
    results = run_to_completion(engine)
    with torch.inference_mode():
        sot_logits = reference(
            input_features=mels, decoder_input_ids=torch.tensor([[tokenizer.special.sot]])
        ).logits[0, -1]
    codes = list(tokenizer.language_tokens)
    their_language = codes[int(sot_logits[[tokenizer.language_tokens[c] for c in codes]].argmax())]
    expected_language = language or their_language
    task_token = tokenizer.special.translate if task == "translate" else tokenizer.special.transcribe
    assert results[0].language == expected_language
    assert request.prompt_tokens[1:3] == [tokenizer.language_tokens[expected_language], task_token]
    expected = hf_greedy_as_engine(reference, mels, engine, request)
    assert results[0].tokens == expected and engine.pool.num_used_blocks == 0
