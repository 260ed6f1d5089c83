"""The bundled models' tokenizers, and small random Whisper models saved as transformers saves them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from engine.model.weights import resolve_model_folder

# A GPU machine has no bundled models: there, these variables name carried tokenizer files.
TOKENIZER_VARIABLES = {"tiny.en": "WHISPER_DISAGG_EN_TOKENIZER", "base": "WHISPER_DISAGG_TOKENIZER"}

# Two encoder and two decoder layers of width 64: the plumbing of a real Whisper at a tiny cost.
RANDOM_WHISPER_SHAPE = dict(
    num_mel_bins=80,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_source_positions=1500,
    max_target_positions=448,
)


def bundled_tokenizer(model: str) -> Path:
    """The tokenizer.json of a bundled model (tiny.en: English-only, base: multilingual)."""
    carried = os.environ.get(TOKENIZER_VARIABLES[model])
    return Path(carried) if carried else resolve_model_folder(model) / "tokenizer.json"


def save_random_whisper(folder: Path, seed: int, tokenizer: str, **config) -> Path:
    """A random Whisper of RANDOM_WHISPER_SHAPE saved into ``folder`` by transformers, with the
    bundled ``tokenizer`` model's tokenizer; ``config``: its other WhisperConfig fields (or shape
    fields to change)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    WhisperForConditionalGeneration(WhisperConfig(**(RANDOM_WHISPER_SHAPE | config))).save_pretrained(folder)
    shutil.copy(bundled_tokenizer(tokenizer), folder / "tokenizer.json")
    return folder
