"""Random-weight Whispers of the real large shapes, as transformers models and as our engine's,
sharing one set of weights: for the GPU agreement tests and the GPU benchmarks (the real
checkpoints do not fit the carried working tree)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model.loading import LoadedModel, load_model
from engine.model.weights import hugging_face_weights

SHAPES: dict[str, dict] = {
    "large-v3": dict(
        vocab_size=51866,
        num_mel_bins=128,
        d_model=1280,
        encoder_layers=32,
        decoder_layers=32,
        encoder_attention_heads=20,
        decoder_attention_heads=20,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
    ),
    "large-v3-turbo": dict(
        vocab_size=51866,
        num_mel_bins=128,
        d_model=1280,
        encoder_layers=32,
        decoder_layers=4,
        encoder_attention_heads=20,
        decoder_attention_heads=20,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
    ),
    # For trying the scripts on a CPU: tiny.en's layout with a multilingual vocabulary.
    "tiny": dict(
        vocab_size=51866,
        num_mel_bins=128,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
    ),
}


def random_hf_whisper(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    """transformers' WhisperForConditionalGeneration with random weights of ``shape`` (SDPA attention)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(
        **SHAPES[shape], max_source_positions=1500, max_target_positions=448, attn_implementation="sdpa"
    )
    with torch.device(device):
        model = WhisperForConditionalGeneration(config)
    return model.to(dtype).eval()


def engine_model(hf_model, tokenizer_file: Path, config: EngineConfig) -> LoadedModel:
    """Our engine's model holding the same weights as ``hf_model``."""
    weights = hugging_face_weights(
        "random-" + str(hf_model.config.d_model),
        Path("."),
        hf_model.config.to_dict(),
        hf_model.state_dict(),
        tokenizer_file,
        {},
    )
    return load_model(config, weights)
