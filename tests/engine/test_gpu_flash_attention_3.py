"""On a Hopper GPU with a FlashAttention-3 build installed (engine.gpu.encoder_attention): the
encoder whose attention runs through FlashAttention-3 gives the SDPA encoder's states, compiled and
replayed from its CUDA graphs, with 16-bit and with FP8 products. Skips where it cannot run (no
CUDA, another GPU than Hopper, or no build: engine/attention/flash_attention_3.py says which)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.flash_attention_3 import (
    attention_dtype,
    flash_attention_3_problem,
    installed_flash_attention_3,
)
from engine.config import EngineConfig
from engine.encode.runner import EncoderRunner
from engine.model.fp8 import fp8_supported
from tests.support.gpu_models import engine_model, random_hf_whisper
from tests.support.models import bundled_tokenizer
from tests.support.speech import short_english_clips, windows_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def relative_error(states: torch.Tensor, expected: torch.Tensor) -> float:
    return ((states.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("fp8_encoder", [False, True], ids=["fp16", "fp8"])
def test_flash_attention_3_gives_the_sdpa_encoders_states_compiled_and_replayed_from_graphs(fp8_encoder):
    problem = flash_attention_3_problem(torch.device("cuda"), 64)
    if problem is not None:
        pytest.skip(problem)
    if fp8_encoder and not fp8_supported(torch.device("cuda")):
        pytest.skip("FP8 tensor cores needed")
    build = installed_flash_attention_3()
    if attention_dtype(build, torch.float16, fp8_products=fp8_encoder) is None:
        pytest.skip(f"the installed build ({build.module}) has no kernels for this encoder")
    hf = random_hf_whisper("large-v3-turbo", "cuda", torch.float16)

    def runner(attention: str, fp8: bool = fp8_encoder) -> EncoderRunner:
        gpu = {"fp8_encoder": fp8, "encoder_cuda_graphs": True, "encoder_attention": attention}
        settings = EngineConfig(
            model="large-v3-turbo", device="cuda", dtype="float16", gpu=gpu, kv_cache_memory_mb=256
        )
        return EncoderRunner(engine_model(hf, bundled_tokenizer("base"), settings), graph_batch_size=8)

    sdpa, flash = runner("sdpa"), runner("flash_attn_3")
    assert sdpa.attention == "sdpa" and flash.attention.startswith("FlashAttention-3"), flash.attention
    audio = windows_of([clip.path for clip in short_english_clips()[:9]]).cuda()
    # 16-bit attention agrees to its rounding. FP8's quantizations turn any change of rounding
    # ahead of them into e4m3 steps, so there the bound is FP8's own distance from the 16-bit
    # encoder: FlashAttention-3 must move the states less than FP8 itself does.
    fp16_sdpa = runner("sdpa", fp8=False) if fp8_encoder else None
    for count in (2, 3, 8, 9):  # replayed from the graphs of 2, 4 and 8 windows; 9 compiled
        expected = sdpa.encode(audio[:count])
        bound = relative_error(expected, fp16_sdpa.encode(audio[:count])) if fp16_sdpa else 0.01
        relative = relative_error(flash.encode(audio[:count]), expected)
        assert relative < bound, (count, relative, bound)
