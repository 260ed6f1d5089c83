"""The decoder's widening products (QKV, the MLP's first) with column-major weights on a CPU
(TextDecoder.store_widening_weights_column_major): the same weights in another memory order, so the
same function to float noise; greedy parity with transformers runs through it (test_parity_hf.py)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model.loading import load_model


def test_a_cpu_decoder_stores_its_widening_weights_column_major_and_computes_the_same_layers(tiny_en):
    decoder = tiny_en.model.decoder
    for layer in decoder.layers:
        for linear in (layer.self_qkv, layer.mlp.fc1):
            assert linear.weight.t().is_contiguous(), "loaded column-major on a CPU"
        assert layer.mlp.fc2.weight.is_contiguous(), "a narrowing product keeps the row-major layout"
    hidden = torch.randn(3, decoder.dims.d_model, generator=torch.Generator().manual_seed(0))
    row_major = load_model(EngineConfig(model="tiny.en", dtype="float32")).model.decoder
    for layer in row_major.layers:
        for linear in (layer.self_qkv, layer.mlp.fc1):
            linear.weight.data = linear.weight.data.contiguous()
    with torch.inference_mode():
        for ours, theirs in zip(decoder.layers, row_major.layers):
            assert torch.equal(ours.self_qkv.weight, theirs.self_qkv.weight)
            torch.testing.assert_close(ours.self_qkv(hidden), theirs.self_qkv(hidden), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours.mlp(hidden), theirs.mlp(hidden), rtol=1e-5, atol=1e-5)
