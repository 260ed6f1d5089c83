"""The output projection tied to the embedding (engine/model/vocabulary.py): with its rows padded to
an aligned count (what a GPU's loading does), the embedding reads the same weights without a second
copy and the logits are the unpadded product's. The GPU's own run of it is in
tests/engine/test_gpu_agreement.py."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model.loading import load_model


def test_padded_vocabulary_rows_keep_one_copy_of_the_weights_and_the_same_logits_and_embeddings():
    decoder = load_model(EngineConfig(model="tiny.en", dtype="float32")).model.decoder
    vocabulary = decoder.vocabulary
    assert vocabulary.padded is None, "a CPU keeps the vocabulary as loaded"
    weight_before = decoder.embed_tokens.weight.detach().clone()
    hidden = torch.randn(6, decoder.dims.d_model, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([0, 7, weight_before.shape[0] - 1])
    with torch.inference_mode():
        logits_before, embedded_before = decoder.logits(hidden), decoder.embed_tokens(tokens)
        vocabulary.pad_rows(multiple=64)
        assert vocabulary.padded.shape[0] % 64 == 0 and vocabulary.padded.shape[0] > weight_before.shape[0]
        assert decoder.embed_tokens.weight.data_ptr() == vocabulary.padded.data_ptr()
        assert torch.equal(decoder.embed_tokens.weight, weight_before)
        assert not vocabulary.padded[weight_before.shape[0] :].any()
        logits = decoder.logits(hidden)
        assert logits.shape == logits_before.shape and logits.is_contiguous()
        torch.testing.assert_close(logits, logits_before, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), logits_before.argmax(-1))
        assert torch.equal(decoder.embed_tokens(tokens), embedded_before)
