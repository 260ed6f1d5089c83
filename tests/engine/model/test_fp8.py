"""FP8 encoder products (engine/model/fp8.py). CPUs run torch's ``_scaled_mm`` with the same
e4m3 rounding and scales as a GPU (slowly), so the arithmetic is checked here; speed and accuracy
on real weights on a GPU are benchmarks/bench_gpu.py --fp8-encoder and
tests/engine/test_gpu_real_weights.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.kv.sources import CrossKVTensor
from engine.model.fp8 import E4M3, Fp8Linear, quantize_linears, quantize_rows
from engine.model.loading import load_model
from engine.types import DecodeOptions
from tests.support.engines import cross_kv_of, decode_one
from tests.support.speech import SPEECH_DIR


def test_rows_quantize_to_e4m3_with_their_largest_value_at_448_and_round_trip_within_its_spacing():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows six decades apart
    values, scale = quantize_rows(x)
    assert values.dtype == E4M3 and scale.shape == (64, 1)
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((64,), 448.0))
    # e4m3 keeps 3 mantissa bits: a value is off by at most 1/16 of itself (or of the row's
    # smallest normal step, for values far below the row's largest).
    error = (values.float() * scale - x).abs()
    assert bool((error <= x.abs() / 16 + scale * 2**-6).all())
    zeros, zero_scale = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(zeros.float() * zero_scale, torch.zeros(2, 8)), "a row of zeros stays zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_fp8_linear_is_the_linear_within_fp8s_error_and_keeps_the_dtype(dtype):
    torch.manual_seed(1)
    linear = nn.Linear(384, 1536).to(dtype)
    fp8 = Fp8Linear(linear)
    x = torch.randn(3, 100, 384).to(dtype)
    out, expected = fp8(x), linear(x)
    assert out.dtype == dtype and out.shape == expected.shape
    relative = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert 0.005 < relative < 0.06, relative  # quantized, and by no more than e4m3's rounding


@pytest.mark.slow
def test_a_tiny_en_encoder_in_fp8_transcribes_a_clip_as_the_float_encoder_does(tiny_en):
    clip = SPEECH_DIR / "jfk.flac"
    _, float_result = decode_one(
        DecoderEngine(tiny_en), CrossKVTensor(cross_kv_of(tiny_en, clip)), DecodeOptions()
    )
    loaded = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    loaded.model.encoder.quantize_fp8()
    quantize_linears(loaded.model.decoder, ["cross_kv"])
    assert isinstance(loaded.model.encoder.layers[0].mlp.fc2, Fp8Linear)
    _, fp8_result = decode_one(
        DecoderEngine(loaded), CrossKVTensor(cross_kv_of(loaded, clip)), DecodeOptions()
    )
    assert fp8_result.text == float_result.text


def test_fp8_encoder_is_a_cuda_switch_and_off_on_a_cpu():
    assert EngineConfig(device="cuda", gpu={"fp8_encoder": True}).gpu_switches().fp8_encoder
    assert not EngineConfig(device="cuda").gpu_switches().fp8_encoder, "off unless asked for"
    assert not EngineConfig(device="cpu", gpu={"fp8_encoder": True}).gpu_switches().fp8_encoder


@pytest.mark.parametrize("gelu", [True, False])
@pytest.mark.parametrize("cols", [5120, 2048, 1280, 1000])
def test_the_row_quantize_kernel_covers_every_column_of_a_row_of_any_width(cols, gelu):
    """Under Triton's CPU interpreter: every column, in both of the kernel's pieces of a row (5120 =
    4096 + 1024; 2048 in one; 1280 = 1024 + 256; 1000 = 512 + a masked 512), is written, and each
    row's scale is its largest value (after GELU, for fc2's input) over 448, found in the last
    column, the tail's. The interpreter casts to e4m3 its own way, at times a power of two below
    the nearest value, so values are held to within a factor of two here; the GPU test below
    checks the rounding."""
    from engine.kernels import triton_available
    from engine.kernels.quantize_rows import triton_quantize_rows

    if not triton_available():
        pytest.skip("triton is not installed")
    torch.manual_seed(3)
    x = (torch.randn(4, cols) * 3).half()
    x[:, -1] = 20.0  # the largest value of each row in its last column: the tail piece's
    values, scale = triton_quantize_rows(x, gelu=gelu)
    expected = torch.nn.functional.gelu(x.float(), approximate="tanh") if gelu else x.float()
    torch.testing.assert_close(scale, expected.abs().amax(dim=1, keepdim=True) / 448.0, rtol=1e-6, atol=0)
    error = (values.float() * scale - expected).abs()
    assert bool((error <= expected.abs() / 2 + scale * 2**-6).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gelu", [True, False])
@pytest.mark.parametrize("cols", [5120, 2048, 1280, 1000])
def test_on_the_gpu_the_row_quantize_kernel_gives_the_values_and_scales_of_the_operations_it_fuses(
    cols, gelu
):
    """(Triton's CPU interpreter does not round to e4m3 as the GPU does, so this runs on a GPU.)"""
    from engine.kernels.quantize_rows import gelu_quantize_rows_op, quantize_rows_op

    torch.manual_seed(2)
    x = (torch.randn(3000, cols, device="cuda") * 3).half()
    values, scale = (gelu_quantize_rows_op if gelu else quantize_rows_op)(x)
    expected = torch.nn.functional.gelu(x.float(), approximate="tanh") if gelu else x.float()
    expected_values, expected_scale = quantize_rows(expected)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    # The kernel's GELU (through exp) may differ from torch's (through tanh) by an ulp, and it
    # multiplies by the scale's reciprocal where quantize_rows divides: either can move a value
    # across a rounding boundary.
    assert (values.float() == expected_values.float()).float().mean().item() > 0.999


@pytest.mark.parametrize("with_delta", [True, False])
def test_the_norm_quantize_kernel_adds_normalises_and_scales_each_row(with_delta):
    """engine/kernels/fused_norm.py's kernel with quantized output, under Triton's CPU interpreter:
    the sum exactly ``x + delta`` in 16 bits, each row's scale that of its 16-bit layer norm, the
    values within a factor of two (the interpreter's own e4m3 cast: the GPU test below checks the
    rounding). 1280 columns: a masked block of 2048."""
    from engine.kernels import triton_available
    from engine.kernels.fused_norm import add_layer_norm_quantize_rows_op, layer_norm_quantize_rows_op

    if not triton_available():
        pytest.skip("triton is not installed")
    torch.manual_seed(4)
    x, delta = (torch.randn(6, 1280) * 2).half(), torch.randn(6, 1280).half()
    weight, bias = (torch.rand(1280) + 0.5).half(), (torch.randn(1280) * 0.1).half()
    if with_delta:
        total, values, scale = add_layer_norm_quantize_rows_op(x, delta, weight, bias, 1e-5)
        assert torch.equal(total, x + delta)
    else:
        total = x
        values, scale = layer_norm_quantize_rows_op(x, weight, bias, 1e-5)
    normed = torch.nn.functional.layer_norm(total.float(), (1280,), weight.float(), bias.float(), 1e-5).half()
    expected_values, expected_scale = quantize_rows(normed.float())
    assert values.dtype == E4M3 and scale.shape == (6, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-3, atol=0)
    error = (values.float() * scale - normed.float()).abs()
    assert bool((error <= normed.float().abs() / 2 + scale * 2**-6).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_norm_quantize_kernel_gives_the_values_of_the_operations_it_fuses():
    from engine.kernels.fused_norm import add_layer_norm_quantize_rows_op

    torch.manual_seed(5)
    x, delta = (
        (torch.randn(3000, 1280, device="cuda") * 2).half(),
        torch.randn(3000, 1280, device="cuda").half(),
    )
    weight = (torch.rand(1280, device="cuda") + 0.5).half()
    bias = (torch.randn(1280, device="cuda") * 0.1).half()
    total, values, scale = add_layer_norm_quantize_rows_op(x, delta, weight, bias, 1e-5)
    normed = torch.nn.functional.layer_norm(x + delta, (1280,), weight, bias, 1e-5)
    expected_values, expected_scale = quantize_rows(normed)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-3, atol=0)
    # The kernel's statistics may round differently from torch's layer norm by an ulp of the
    # 16-bit output, and it multiplies by the scale's reciprocal: either can cross a rounding boundary.
    assert (values.float() == expected_values.float()).float().mean().item() > 0.995


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fp8_encoders_fused_kernels_give_the_states_of_its_separate_operations():
    """The FP8 encoder through EncoderLayer.forward_fp8 (one kernel for each add, norm and
    quantization), eager and compiled as the engine runs it, against the same quantized weights
    through the layers' own forward (the norms, adds and quantizations as separate operations):
    the same states within rounding."""
    from engine.model.weights import ModelDims
    from engine.model.whisper import AudioEncoder

    torch.manual_seed(6)
    dims = ModelDims(
        n_mels=80,
        n_audio_ctx=1500,
        d_model=384,
        encoder_layers=2,
        encoder_heads=6,
        encoder_ffn_dim=1536,
        decoder_layers=1,
        decoder_heads=6,
        decoder_ffn_dim=1536,
        vocab_size=51865,
        n_text_ctx=448,
    )
    encoder = AudioEncoder(dims)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.05)
    encoder = encoder.to("cuda", torch.float16).eval()
    encoder.quantize_fp8()
    mels = torch.randn(2, 80, 3000, device="cuda")
    with torch.no_grad():
        fused = encoder(mels).float()
        compiled = torch.compile(encoder)(mels).float()
        encoder.fp8_kernels = False
        separate = encoder(mels).float()
    for states in (fused, compiled):
        relative = ((states - separate).norm() / separate.norm()).item()
        assert relative < 0.01, relative
