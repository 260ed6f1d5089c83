"""FlashAttention-3 for the encoder (engine/attention/flash_attention_3.py): which builds can serve
which encoder, and the encoder's plumbing around the kernel. The kernel itself runs on Hopper GPUs
only; tests/engine/test_gpu_flash_attention_3.py compares it with SDPA there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from engine.attention.flash_attention_3 import (
    MIN_WINDOWS,
    FlashAttention3,
    attention_dtype,
    build_capabilities,
    flash_attention_3_problem,
)
from engine.config import EngineConfig, GPUSwitches
from engine.encode.runner import EncoderRunner
from engine.model.audio import log_mel_spectrogram
from engine.model.fp8 import Fp8Linear
from engine.model.loading import load_model
from tests.support.speech import short_english_clips, windows_of

# The build flags of the two FlashAttention-3 wheels on the package registry, as their config
# modules ship them (the flags that decide dtypes and head sizes).
TOKENSPEED_FA3_FLAGS = {
    "FLASHATTENTION_DISABLE_FP16": False,
    "FLASHATTENTION_DISABLE_FP8": False,
    "FLASHATTENTION_DISABLE_HDIM64": False,
    "FLASHATTENTION_DISABLE_HDIM96": True,
    "FLASHATTENTION_DISABLE_HDIM128": False,
    "FLASHATTENTION_DISABLE_HDIM192": False,
    "FLASHATTENTION_DISABLE_HDIM256": False,
}
FA3_FWD_FLAGS = {
    **TOKENSPEED_FA3_FLAGS,
    "FLASHATTENTION_DISABLE_FP16": True,
    "FLASHATTENTION_DISABLE_HDIM96": False,
}


def build_of(flags: dict[str, bool], forward=None) -> FlashAttention3:
    return FlashAttention3("a build", forward, *build_capabilities(flags))


def test_a_builds_flags_say_which_dtypes_and_head_sizes_it_has_kernels_for():
    dtypes, head_dims = build_capabilities(TOKENSPEED_FA3_FLAGS)
    assert dtypes == {torch.float16, torch.bfloat16} and head_dims == {64, 128, 192, 256}
    dtypes, head_dims = build_capabilities(FA3_FWD_FLAGS)
    assert dtypes == {torch.bfloat16} and 64 in head_dims and 96 in head_dims


def test_fp8_products_take_bf16_attention_where_the_build_has_it_and_16_bit_encoders_their_own_dtype():
    both, bf16_only = build_of(TOKENSPEED_FA3_FLAGS), build_of(FA3_FWD_FLAGS)
    assert attention_dtype(both, torch.float16, fp8_products=True) == torch.bfloat16
    assert attention_dtype(bf16_only, torch.float16, fp8_products=True) == torch.bfloat16
    fp16_only = FlashAttention3("a build", None, frozenset({torch.float16}), frozenset({64}))
    assert attention_dtype(fp16_only, torch.float16, fp8_products=True) == torch.float16
    assert attention_dtype(both, torch.float16, fp8_products=False) == torch.float16
    # A 16-bit encoder is not cast for the kernel: a build without its dtype does not serve it.
    assert attention_dtype(bf16_only, torch.float16, fp8_products=False) is None
    assert attention_dtype(both, torch.float32, fp8_products=False) is None


def test_on_a_cpu_flash_attention_3_is_ruled_out_by_the_device_and_the_switch_resolves_to_sdpa():
    assert "CUDA" in flash_attention_3_problem(torch.device("cpu"), 64)
    switches = GPUSwitches(encoder_attention="flash_attn_3").resolve("cpu", torch.float32)
    assert switches.encoder_attention == "sdpa"
    loaded = load_model(EngineConfig(model="tiny.en", gpu={"encoder_attention": "flash_attn_3"}))
    assert EncoderRunner(loaded).attention == "sdpa"
    assert loaded.model.encoder.layers[0].flash_attention is None


def test_an_unknown_encoder_attention_is_refused_at_start_up_naming_the_choices():
    with pytest.raises(ValidationError) as refused:
        GPUSwitches(encoder_attention="flash")
    assert "encoder_attention" in str(refused.value) and "flash_attn_3" in str(refused.value)


class SdpaWithTheKernelsContract:
    """Attention with FlashAttention-3's forward contract ([N, frames, heads, dim] strided in, a
    tuple whose first item is [N, frames, heads, dim] out), computed by SDPA: what the encoder's
    routing around the kernel is checked against on a CPU. Counts its calls."""

    def __init__(self):
        self.calls: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __call__(self, q, k, v, causal):
        assert not causal and q.stride(-1) == 1
        self.calls.append((q.dtype, tuple(q.shape)))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return (out.transpose(1, 2).contiguous(),)


def encoder_states(loaded, mels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model.encoder(mels).float()


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8 products"])
def test_the_encoder_routes_each_layers_attention_through_the_kernel_and_gives_sdpas_states(fp8):
    """tiny.en's encoder with every layer's attention through a kernel of FlashAttention-3's
    contract: the layout in and out is right (the states equal plain SDPA's), every layer calls
    it from MIN_WINDOWS windows on and none below, and with FP8 products the QKV product leaves
    straight in the kernel's bf16."""
    audio = windows_of([clip.path for clip in short_english_clips()[:MIN_WINDOWS]])
    plain, routed = (load_model(EngineConfig(model="tiny.en", dtype="float32")) for _ in range(2))
    if fp8:
        for loaded in (plain, routed):
            loaded.model.encoder.quantize_fp8()
    mels = log_mel_spectrogram(audio, plain.weights.dims.n_mels)
    kernel = SdpaWithTheKernelsContract()
    dtype = torch.bfloat16 if fp8 else torch.float32
    routed.model.encoder.use_flash_attention(build_of(TOKENSPEED_FA3_FLAGS, kernel), dtype)
    encoder_states(routed, mels[: MIN_WINDOWS - 1])
    assert kernel.calls == [], "fewer windows than MIN_WINDOWS take SDPA"
    expected, states = encoder_states(plain, mels), encoder_states(routed, mels)
    layers = plain.weights.dims.encoder_layers
    assert kernel.calls == [(dtype, (MIN_WINDOWS, 1500, 6, 64))] * layers
    if fp8:
        qkv = routed.model.encoder.layers[0].qkv
        assert isinstance(qkv, Fp8Linear) and qkv.dtype == torch.bfloat16 and qkv.bias.dtype == torch.bfloat16
        relative = ((states - expected).norm() / expected.norm()).item()
        # Any change of rounding ahead of FP8's quantizations moves tiny.en's states by ~3% (fp16
        # attention instead of fp32: 3.2%, bf16: 3.6%); a wrong layout would move them by ~100%.
        assert relative < 0.06, relative
    else:
        torch.testing.assert_close(states, expected, atol=1e-4, rtol=1e-4)
