"""Half precision in the decoder: logits come out in float32, and an overflow fails the window in
words (never garbage tokens, never a crash), with its blocks freed.

CPUs run fp16 slowly but exactly as the dtype rounds, so these run everywhere; the same paths on a
GPU, on real weights over the speech set, are in tests/engine/test_gpu_real_weights.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.decode.scheduler import non_finite_logits_error
from engine.kv.sources import CrossKVTensor
from engine.model.loading import LoadedModel, load_model
from engine.types import DecodeOptions, FallbackOptions, FinishReason
from tests.support.engines import cross_kv_of, decode_one, engine_with
from tests.support.speech import SPEECH_DIR

JFK = SPEECH_DIR / "jfk.flac"
FP16_MAX = torch.finfo(torch.float16).max


def tiny_en_fp16() -> LoadedModel:
    return load_model(EngineConfig(model="tiny.en", dtype="float16"))


@pytest.fixture(scope="module")
def fp16_jfk_cross_kv() -> torch.Tensor:
    """The fp16 tiny.en's cross-attention K/V of JFK, encoded once (fp16 runs slowly on a CPU) for
    the tests whose fp16 model keeps its encoder and cross-K/V projection as loaded."""
    return cross_kv_of(tiny_en_fp16(), JFK)


def test_cuda_runs_float16_unless_told_otherwise():
    assert EngineConfig(device="cuda").dtype == "float16"
    assert EngineConfig(device="cuda", dtype="bfloat16").dtype == "bfloat16"
    assert EngineConfig().dtype == "float32"


def test_half_precision_logits_are_float32_products_not_rounded_ones():
    loaded = tiny_en_fp16()
    hidden = torch.randn(4, loaded.weights.dims.d_model).half()
    logits = loaded.model.decoder.logits(hidden)
    weight = loaded.model.decoder.embed_tokens.weight.float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ weight.T, rtol=1e-5, atol=1e-4)
    assert not torch.equal(logits, logits.half().float()), "the logits were rounded to fp16"


@pytest.mark.slow
def test_fp16_decodes_a_clip_to_the_tokens_fp32_does(tiny_en, fp16_jfk_cross_kv):
    _, fp32 = decode_one(DecoderEngine(tiny_en), CrossKVTensor(cross_kv_of(tiny_en, JFK)), DecodeOptions())
    engine = DecoderEngine(tiny_en_fp16())
    _, fp16 = decode_one(engine, CrossKVTensor(fp16_jfk_cross_kv), DecodeOptions())
    assert fp16.finish_reason == FinishReason.STOP and fp16.tokens == fp32.tokens
    assert engine.pool.num_used_blocks == 0


def test_an_overflow_names_a_cure_only_where_the_deployment_has_one():
    assert "engine.dtype bfloat16 or float32" in non_finite_logits_error("float16")
    for dtype in ("float32", "bfloat16"):  # float32's range already: no precision to move to
        message = non_finite_logits_error(dtype)
        assert "overflowed" in message and "engine.dtype" not in message and "float16" not in message


@pytest.mark.slow
@pytest.mark.parametrize("where", ["decoder", "encoder"])
@pytest.mark.parametrize("temperature", [0.0, 0.4])
def test_an_fp16_overflow_fails_the_window_in_words_and_frees_its_blocks(
    where, temperature, fp16_jfk_cross_kv
):
    loaded = tiny_en_fp16()
    # A final layer norm scaled to fp16's largest value sends every activation above ~1 to inf:
    # the overflow a model with large activations meets, in the encoder's output or the decoder's.
    norm = loaded.model.encoder.norm if where == "encoder" else loaded.model.decoder.norm
    norm.weight.data.fill_(FP16_MAX)
    engine = DecoderEngine(loaded)
    options = DecodeOptions(temperature=temperature, fallback=FallbackOptions(), seed=1)
    # The decoder's norm is not on the way to the cross K/V: with it changed, they are as loaded.
    cross_kv = cross_kv_of(loaded, JFK) if where == "encoder" else fp16_jfk_cross_kv
    request, result = decode_one(engine, CrossKVTensor(cross_kv), options)
    assert result.finish_reason == FinishReason.ERROR
    assert "overflowed" in result.error and "engine.dtype" in result.error
    assert request.attempt == 0, "an overflow is not retried hotter: every temperature would overflow"
    assert result.tokens == []
    assert engine.pool.num_used_blocks == 0 and not engine.has_work


@pytest.mark.parametrize("async_steps", [False, True], ids=["host-choices", "device-choices"])
def test_an_overflow_in_the_middle_of_a_beam_search_fails_its_window_in_words_and_frees_its_blocks(
    async_steps, fp16_jfk_cross_kv
):
    """Beside a greedy window. With async steps the beam window's choices are being made on the
    device when its logits stop being finite: its rows are read from the device's ranking, not one
    by one, and the overflow must still fail it."""
    loaded = tiny_en_fp16()
    engine = engine_with(loaded, async_steps=async_steps)
    cross_kv = fp16_jfk_cross_kv
    beams = engine.make_request(DecodeOptions(beam_size=5), CrossKVTensor(cross_kv), "beams")
    greedy = engine.make_request(DecodeOptions(), CrossKVTensor(cross_kv), "greedy")
    engine.submit(beams)
    engine.submit(greedy)
    results = {}
    chosen_on_device_at_overflow = None
    for step in range(200):
        if step == 8:
            # From here on every activation above ~1 overflows: the model's own fp16 overflow path.
            chosen_on_device_at_overflow = not beams.search.host_chose_last
            loaded.model.decoder.norm.weight.data.fill_(FP16_MAX)
        results |= {result.request_id: result for result in engine.step()}
        if not engine.has_work:
            break
    assert chosen_on_device_at_overflow is async_steps
    for request_id in ("beams", "greedy"):
        assert results[request_id].finish_reason == FinishReason.ERROR, request_id
        assert "overflowed" in results[request_id].error
    assert engine.pool.num_used_blocks == 0 and not engine.has_work
