"""The encoder's self-attention as explicit products on a CPU in bf16 (engine/model/cpu_attention.py):
the same function as torch's SDPA, and in the bf16 encoder no further from float32 than SDPA is.
Its effect on transcripts is in test_accuracy.py (cpu_dtype bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig, cpu_has_bf16_instructions
from engine.model.audio import load_audio_file, log_mel_spectrogram, pad_or_trim
from engine.model.cpu_attention import QUERY_CHUNK, attention_by_products
from engine.model.loading import load_model
from tests.support.speech import SPEECH_DIR

needs_bf16 = pytest.mark.skipif(
    not cpu_has_bf16_instructions(), reason="the engine runs bf16 only with bf16 instructions"
)


def packed_qkv(batch: int, frames: int, heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as the encoder makes them: strided [N, H, L, D] views of one [N, L, 3, H, D] product."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, frames, 3, heads, 64, generator=generator).to(dtype)
    return tuple(qkv.permute(2, 0, 3, 1, 4))


def test_in_float32_the_products_compute_sdpa_to_float_noise_across_query_slices():
    frames = 2 * QUERY_CHUNK + 100  # two whole slices and a partial one
    q, k, v = packed_qkv(2, frames, 3, torch.float32)
    out = attention_by_products(q, k, v)
    assert out.shape == (2, frames, 3, 64) and out.is_contiguous()
    expected = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_in_bf16_the_products_stay_within_a_few_bf16_steps_of_float32():
    """The scores are rounded to bf16 before the softmax (SDPA keeps them in fp32): on unit-scale
    inputs (outputs ~0.05) each output stays within 0.005 of float32's attention over the same bf16
    inputs. Measured when written: max 0.0034, mean 0.0002 (SDPA in bf16: 0.0011, 0.0001)."""
    q, k, v = packed_qkv(1, 700, 2, torch.bfloat16)
    out = attention_by_products(q, k, v)
    assert out.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2)
    error = (out.float() - exact).abs()
    assert error.max() <= 0.005 and error.mean() <= 0.0005


@needs_bf16
def test_the_bf16_encoder_with_products_is_as_close_to_float32_as_with_sdpa_on_speech():
    float32 = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    bf16 = load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16"))
    assert all(layer.attention_by_products for layer in bf16.model.encoder.layers)
    assert not any(layer.attention_by_products for layer in float32.model.encoder.layers)
    samples = torch.from_numpy(pad_or_trim(load_audio_file(SPEECH_DIR / "jfk.flac")))
    mels = log_mel_spectrogram(samples[None], 80)
    with torch.inference_mode():
        exact = float32.model.encoder(mels)
        by_products = bf16.model.encoder(mels).float()
        for layer in bf16.model.encoder.layers:
            layer.attention_by_products = False
        by_sdpa = bf16.model.encoder(mels).float()

    def relative_error(states: torch.Tensor) -> float:
        return float((states - exact).norm() / exact.norm())

    # Measured when written: 1.52% against SDPA's 1.45%.
    assert relative_error(by_products) <= 1.25 * relative_error(by_sdpa)


@needs_bf16
def test_the_bf16_cross_kv_projection_adds_little_to_the_bf16_encoders_error():
    """cpu_dtype bfloat16 projects the (bf16-exact) encoder states to cross K/V in bf16 as well."""
    float32 = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    bf16 = load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16"))
    states = torch.randn(1, 1500, 384, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    with torch.inference_mode():
        exact = float32.model.decoder.project_cross_kv(states)
        projected = bf16.model.decoder.project_cross_kv(states)
    assert projected.dtype == torch.bfloat16 and projected.shape == exact.shape
    assert float((projected.float() - exact).norm() / exact.norm()) <= 2**-8


def test_float32_scores_from_bf16_inputs_are_closer_to_float32_than_bf16_scores():
    """cpu_dtype 'bfloat16-products' keeps the scores and softmax in float32 and rounds only the
    probabilities to bf16: nearer float32's attention over the same bf16 inputs than the bf16 scores."""
    q, k, v = packed_qkv(1, 700, 2, torch.bfloat16)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2)
    wide = attention_by_products(q, k, v, scores_dtype=torch.float32)
    narrow = attention_by_products(q, k, v)
    assert wide.dtype == torch.bfloat16 and wide.shape == exact.shape
    wide_error, narrow_error = (wide.float() - exact).abs(), (narrow.float() - exact).abs()
    assert wide_error.mean() < 0.7 * narrow_error.mean()
    assert wide_error.max() <= 0.005


@needs_bf16
def test_the_encoder_with_bf16_products_keeps_a_float32_stream_and_lands_nearer_float32():
    """engine.cpu_dtype 'bfloat16-products': every encoder product runs on bf16 weights, the
    convolutions and norms stay float32, the states come out float32, and on speech they are
    nearer float32's states than the wholly-bf16 encoder's."""
    float32 = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    products = load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16-products"))
    bf16 = load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16"))
    encoder = products.model.encoder
    for layer in encoder.layers:
        assert {layer.qkv.weight.dtype, layer.mlp.fc2.weight.dtype} == {torch.bfloat16}
        assert layer.attn_norm.weight.dtype == torch.float32 and layer.attention_by_products
    assert encoder.conv1.weight.dtype == torch.float32
    assert products.config.encoder_precision == "float32 with bf16 products on CPU"
    samples = torch.from_numpy(pad_or_trim(load_audio_file(SPEECH_DIR / "jfk.flac")))
    mels = log_mel_spectrogram(samples[None], 80)
    with torch.inference_mode():
        exact = float32.model.encoder(mels)
        by_products = encoder(mels)
        wholly_bf16 = bf16.model.encoder(mels).float()

    def relative_error(states: torch.Tensor) -> float:
        return float((states - exact).norm() / exact.norm())

    assert by_products.dtype == torch.float32
    # Measured when written: 0.75% against 1.52% (the weights rounded to bf16 are most of what is left).
    assert relative_error(by_products) < 0.6 * relative_error(wholly_bf16)
