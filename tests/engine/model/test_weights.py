"""Model names resolve to folders, folders of either format load, and broken ones say which file."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import WhisperForConditionalGeneration

from engine.errors import ModelNotFoundError, WeightsFormatError
from engine.model.weights import load_weights, resolve_model_folder


def test_bundled_tiny_en_loads_from_ctranslate2_with_its_real_shapes():
    weights = load_weights("tiny.en")
    dims = weights.dims
    assert (dims.d_model, dims.encoder_layers, dims.decoder_layers, dims.decoder_heads) == (384, 4, 4, 6)
    assert (dims.vocab_size, dims.n_mels, dims.n_audio_ctx, dims.n_text_ctx) == (51864, 80, 1500, 448)
    assert not dims.is_multilingual
    sd = weights.state_dict
    # The fused CTranslate2 projections come apart into Whisper's unfused ones; k has no bias.
    assert sd["decoder.layers.0.self_attn.q_proj.weight"].shape == (384, 384)
    assert sd["decoder.layers.3.encoder_attn.v_proj.bias"].shape == (384,)
    assert "decoder.layers.0.self_attn.k_proj.bias" not in sd
    assert sd["decoder.embed_tokens.weight"].dtype == torch.float16
    assert weights.suppress_tokens and weights.begin_suppress_tokens == [220, 50256]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hugging_face_folders_load_in_their_saved_dtype(random_whisper_folder, tmp_path, dtype):
    model = WhisperForConditionalGeneration.from_pretrained(random_whisper_folder).to(dtype)
    model.save_pretrained(tmp_path)
    shutil.copy(random_whisper_folder / "tokenizer.json", tmp_path)
    weights = load_weights(str(tmp_path))
    expected = model.model.decoder.layers[1].fc1.weight
    assert weights.state_dict["decoder.layers.1.fc1.weight"].dtype == dtype
    assert torch.equal(weights.state_dict["decoder.layers.1.fc1.weight"], expected)
    assert weights.dims.d_model == 64 and weights.dims.decoder_layers == 2


def test_sharded_hugging_face_checkpoints_load_every_shard(random_whisper_folder, tmp_path):
    model = WhisperForConditionalGeneration.from_pretrained(random_whisper_folder)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    shutil.copy(random_whisper_folder / "tokenizer.json", tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    weights = load_weights(str(tmp_path))
    assert len(weights.state_dict) == len(load_weights(str(random_whisper_folder)).state_dict)


def test_a_truncated_ctranslate2_file_is_reported_by_name(tmp_path):
    bundled = resolve_model_folder("tiny.en")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(bundled / name, tmp_path / name)
    (tmp_path / "model.bin").write_bytes((bundled / "model.bin").read_bytes()[:5000])
    with pytest.raises(WeightsFormatError, match="model.bin"):
        load_weights(str(tmp_path))


def test_a_corrupt_safetensors_file_is_reported_by_name(random_whisper_folder, tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(random_whisper_folder / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsFormatError, match="model.safetensors"):
        load_weights(str(tmp_path))


def test_a_folder_without_a_tokenizer_is_reported(random_whisper_folder, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(random_whisper_folder / name, tmp_path / name)
    with pytest.raises(WeightsFormatError, match="tokenizer.json"):
        load_weights(str(tmp_path))


def test_a_folder_without_weights_is_reported(tmp_path):
    with pytest.raises(WeightsFormatError, match="model.bin"):
        load_weights(str(tmp_path))


def test_unknown_names_and_uncached_hub_ids_raise_model_not_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing downloaded here
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        load_weights("openai/whisper-large-v3")
    with pytest.raises(ModelNotFoundError, match="bundled"):
        load_weights("no-such-model")


def test_encoder_side_keeps_only_the_cross_kv_projections_and_projects_the_same(random_whisper_folder):
    """What an encoder replica frees of the decoder leaves its cross-K/V unchanged."""
    from engine.config import EngineConfig
    from engine.encode.runner import EncoderRunner
    from engine.model.loading import load_model

    config = EngineConfig(model=str(random_whisper_folder))
    full, trimmed = load_model(config), load_model(config)
    full_params = sum(p.numel() for p in full.model.decoder.parameters())
    trimmed.model.decoder.keep_only_cross_kv()
    kept = dict(trimmed.model.decoder.named_parameters())
    assert sorted(kept) == ["cross_kv.bias", "cross_kv.weight"]
    assert sum(p.numel() for p in kept.values()) < full_params / 2
    windows = torch.randn(2, 480000, generator=torch.Generator().manual_seed(0)) * 0.1
    expected = EncoderRunner(full).cross_kv(EncoderRunner(full).encode(windows))
    runner = EncoderRunner(trimmed)
    assert torch.equal(runner.cross_kv(runner.encode(windows)), expected)
