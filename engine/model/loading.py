"""A model loaded once per replica: weights, the Whisper module on its device, the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model.tokenizer import WhisperTokenizer
from engine.model.weights import LoadedWeights, load_weights
from engine.model.whisper import Whisper


@dataclass
class LoadedModel:
    weights: LoadedWeights
    model: Whisper
    tokenizer: WhisperTokenizer
    config: EngineConfig


def load_model(config: EngineConfig, weights: LoadedWeights | None = None) -> LoadedModel:
    """Load ``config.model`` (or take ``weights`` already in memory) onto the configured device."""
    config.check_device_present()
    weights = weights or load_weights(config.model)
    with torch.device("meta"):
        model = Whisper(weights.dims)
    model = model.to_empty(device=config.torch_device).to(config.torch_dtype)
    model.load_canonical_state_dict(weights.state_dict)
    model.encoder.to(config.encoder_torch_dtype)  # a CPU's bf16 encoder beside a float32 decoder
    if config.on_cpu and config.encoder_torch_dtype == torch.bfloat16:
        model.encoder.attend_by_products()
    if config.cpu_bf16_products:
        model.encoder.run_products_in_bf16()
    if config.on_cpu and config.torch_dtype == torch.float32:
        model.decoder.store_widening_weights_column_major()
    if config.torch_device.type == "cuda":
        model.decoder.vocabulary.pad_rows()
    if config.cpu_bf16_logits:
        model.decoder.vocabulary.keep_bf16_copy()
        model.decoder.project_cross_kv_in_bf16()
    model.eval()
    weights.state_dict = {}  # the model holds the (fused) weights now; free the loader's copy
    return LoadedModel(
        weights, model, WhisperTokenizer(weights.tokenizer_file, weights.dims.vocab_size), config
    )
