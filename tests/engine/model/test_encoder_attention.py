"""The encoder's self-attention with cuDNN's fused attention preferred (``engine.gpu.
cudnn_encoder_attention``, on by default on a GPU): the same states as PyTorch's own choice of
attention kernel, within rounding; on a CPU, where cuDNN's kernel does not exist, the next in the
order runs. Speed figures: benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.whisper import AudioEncoder
from engine.model.weights import ModelDims

DIMS = ModelDims(
    n_mels=80,
    n_audio_ctx=1500,
    d_model=256,
    encoder_heads=4,
    encoder_layers=2,
    encoder_ffn_dim=512,
    decoder_layers=1,
    decoder_heads=4,
    decoder_ffn_dim=512,
    n_text_ctx=448,
    vocab_size=51865,
)


def _encoder(device: str, dtype: torch.dtype) -> AudioEncoder:
    torch.manual_seed(0)
    encoder = AudioEncoder(DIMS)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.05)
    return encoder.to(device, dtype).eval()


def test_on_a_cpu_preferring_cudnn_attention_leaves_the_encoder_states_as_they_were():
    encoder = _encoder("cpu", torch.float32)
    mels = torch.randn(2, 80, 3000)
    with torch.no_grad():
        default = encoder(mels)
        encoder.prefer_cudnn_attention()
        preferred = encoder(mels)
    assert all(layer.attention_backends[0] == SDPBackend.CUDNN_ATTENTION for layer in encoder.layers)
    torch.testing.assert_close(preferred, default, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_cudnn_runs_the_encoders_attention_and_agrees_with_flash_attention(dtype):
    encoder = _encoder("cuda", dtype)
    mels = torch.randn(2, 80, 3000, device="cuda")
    qkv = torch.randn(2, 1500, 3, 4, 64, device="cuda", dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # the encoder's strided layout
    with torch.no_grad():
        # cuDNN alone, no fallback: it takes the encoder's shapes and layout on this GPU.
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            by_cudnn = F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            by_flash = F.scaled_dot_product_attention(q, k, v)
            flash_states = encoder(mels)
        encoder.prefer_cudnn_attention()
        cudnn_states = encoder(mels)
    torch.testing.assert_close(by_cudnn, by_flash, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cudnn_states.float(), flash_states.float(), rtol=5e-2, atol=5e-2)
