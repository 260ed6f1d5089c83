"""Shared fixtures: the speech set carried in tests/data, the bundled model, HF reference builders."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels on a machine without CUDA run under Triton's interpreter. It must be set
    # before anything imports triton.language: that import decorates triton's own library
    # functions (tl.zeros, tl.sum, ...), which a kernel interpreted later cannot call otherwise.
    # Some test modules import transformers, which imports triton, so here, before any of them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.config import EngineConfig  # noqa: E402
from engine.model.loading import LoadedModel, load_model  # noqa: E402
from engine.transcribe.evaluation import SpeechClip, load_manifest  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402

SPEECH_DIR = Path(__file__).parent / "data" / "speech"


# A GPU machine has no bundled models: there, these variables name carried tokenizer files.
TOKENIZER_VARIABLES = {"tiny.en": "WHISPER_DISAGG_EN_TOKENIZER", "base": "WHISPER_DISAGG_TOKENIZER"}


def bundled_tokenizer(model: str) -> Path:
    """The tokenizer.json of a bundled model (tiny.en: English-only, base: multilingual)."""
    carried = os.environ.get(TOKENIZER_VARIABLES[model])
    return Path(carried) if carried else resolve_model_folder(model) / "tokenizer.json"


def english_clips() -> list[SpeechClip]:
    """Every clip with a reference transcript (42 English clips, one of them long-form)."""
    return [clip for clip in load_manifest(SPEECH_DIR) if clip.text]


def short_english_clips() -> list[SpeechClip]:
    """The English clips that fit one 30 s window."""
    return [clip for clip in english_clips() if clip.duration_s <= 30]


@pytest.fixture(scope="session")
def tiny_en() -> LoadedModel:
    return load_model(EngineConfig(model="tiny.en"))


@pytest.fixture(scope="session")
def random_whisper_folder(tmp_path_factory) -> Path:
    """A small random English-only Whisper saved by transformers, as a user's HF folder looks."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=51864, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25], begin_suppress_tokens=[220, 50256],
    )
    folder = tmp_path_factory.mktemp("random-whisper")
    WhisperForConditionalGeneration(config).save_pretrained(folder)
    shutil.copy(bundled_tokenizer("tiny.en"), folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="session")
def random_multilingual_whisper_folder(tmp_path_factory) -> Path:
    """A small random multilingual Whisper (99 languages, translate), with base's tokenizer: the
    multilingual plumbing (language detection, the task token) at the cost of a tiny model."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(1)
    config = WhisperConfig(
        vocab_size=51865, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448,
    )
    folder = tmp_path_factory.mktemp("random-multilingual-whisper")
    WhisperForConditionalGeneration(config).save_pretrained(folder)
    shutil.copy(bundled_tokenizer("base"), folder / "tokenizer.json")
    return folder
