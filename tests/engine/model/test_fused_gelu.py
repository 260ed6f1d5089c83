"""The encoder's GELU in the first MLP product's epilogue (``engine.fused_encoder_gelu``, on by
default on a GPU in bf16): the tanh form of GELU, which cuBLASLt's epilogue computes; on a CPU the
same function unfused. Its effect on transcripts is in test_accuracy.py; the H100's speed and
error figures are in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.whisper import MLP


def test_the_fused_mlp_is_the_second_product_of_the_tanh_gelu_of_the_first():
    torch.manual_seed(0)
    mlp = MLP(64, 256)
    x = torch.randn(3, 7, 64) * 2
    with torch.no_grad():
        exact = mlp(x)
        mlp.fused_gelu = True
        fused = mlp(x)
        expected = mlp.fc2(F.gelu(mlp.fc1(x), approximate="tanh"))
    assert fused.shape == exact.shape
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused, exact)  # it is the tanh form, not the exact GELU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fused_product_applies_the_tanh_gelu_in_its_epilogue():
    torch.manual_seed(0)
    mlp = MLP(256, 1024).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    with torch.no_grad():
        expected = mlp.fc2(F.gelu(mlp.fc1(x), approximate="tanh"))
        mlp.fused_gelu = True
        fused = mlp(x)
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
