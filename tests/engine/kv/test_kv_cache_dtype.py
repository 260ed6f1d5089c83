"""An fp8 (e4m3) KV cache: writes saturate instead of overflowing to NaN, the same memory holds
twice the blocks of a bf16 cache, and what is written reads back within fp8's precision.
(Transcripts with it: tests/engine/transcribe/test_accuracy.py; shipped K/V:
tests/kv_transfer/test_kv_transfer.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.decode.engine import DecoderEngine
from engine.kv.storage import PagedKVStorage, to_cache_dtype
from tests.support.engines import engine_with

FP8 = torch.float8_e4m3fn
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
# The CUDA case of a test parametrized by device is a GPU test.
DEVICE_PARAMS = [
    pytest.param(device, marks=[pytest.mark.gpu] if device == "cuda" else []) for device in DEVICES
]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_cast_clamps_values_beyond_448_and_never_makes_nan(source_dtype, device):
    """A plain .to() gives NaN here with torch 2.11 (CPU and CUDA); torch 2.13's CPU cast saturates by
    itself, so on such a machine only the CUDA case tells the clamp's absence."""
    beyond = torch.tensor([449.0, 480.0, 500.0, 1e4, float("inf")])
    values = torch.cat([beyond, -beyond, torch.tensor([0.0, 0.3, -2.5, 447.0])]).to(source_dtype).to(device)
    cached = to_cache_dtype(values, FP8)
    assert cached.dtype == FP8 and cached.device == values.device
    back = cached.float().cpu()
    assert not back.isnan().any()
    assert back[:5].tolist() == [448.0] * 5 and back[5:10].tolist() == [-448.0] * 5
    assert back[10:].tolist() == [0.0, 0.3125, -2.5, 448.0]  # in range: rounded to the nearest e4m3 value


def test_the_cast_to_the_dtype_a_tensor_already_has_is_no_copy():
    kv = torch.randn(4, 8)
    assert to_cache_dtype(kv, torch.float32) is kv


def pool_of(tiny_en, **overrides) -> DecoderEngine:
    return engine_with(tiny_en, **{"kv_cache_memory_mb": 24, **overrides})


def test_an_fp8_pool_holds_twice_the_blocks_of_a_bf16_pool_in_the_same_memory(tiny_en):
    bf16 = pool_of(tiny_en, dtype="bfloat16")
    fp8 = pool_of(tiny_en, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert bf16.runner.storage.cache.dtype == torch.bfloat16 and fp8.runner.storage.cache.dtype == FP8
    assert fp8.pool.num_blocks in (2 * bf16.pool.num_blocks, 2 * bf16.pool.num_blocks + 1)
    assert (
        fp8.runner.storage.cache.nbytes <= 24 * 2**20 + fp8.runner.storage.cache[0].nbytes
    )  # + the null block
    assert (
        pool_of(tiny_en, kv_cache_dtype="fp8_e4m3").pool.num_blocks >= 4 * pool_of(tiny_en).pool.num_blocks
    )  # fp32


def test_blocks_written_to_an_fp8_cache_read_back_within_fp8_precision():
    layers, frames, heads, head_dim, block_size = 2, 37, 3, 16, 8
    storage = PagedKVStorage(12, layers, block_size, heads, head_dim, FP8, torch.device("cpu"))
    kv = torch.randn(layers, 2, frames, heads, head_dim, generator=torch.Generator().manual_seed(0)) * 4
    kv[0, 0, 3, 0, 0], kv[1, 1, 30, 2, 5] = 1000.0, -2000.0  # outliers beyond e4m3's range
    block_ids = [7, 2, 9, 0, 4]
    storage.write_sequence(block_ids, kv)

    blocks = storage.read_blocks(block_ids)  # [5, layers, 2, block_size, H, D]
    assert blocks.dtype == FP8
    read = blocks.float().permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, -1, heads, head_dim)
    assert not read[:, :, frames:].any(), "the last block's padding slots must be zero"
    read, expected = read[:, :, :frames], kv.clamp(-448, 448)
    assert read[0, 0, 3, 0, 0] == 448 and read[1, 1, 30, 2, 5] == -448
    # e4m3 keeps 3 mantissa bits: round to nearest is off by at most 1/16 of a normal value, and by
    # at most half the smallest subnormal step (2^-9 / 2) below the normal range (2^-6).
    error_bound = torch.maximum(expected.abs() / 16, torch.tensor(2.0**-10))
    assert ((read - expected).abs() <= error_bound).all()
    assert not storage.read_blocks([1, 3, 5]).float().any(), "a write landed outside its blocks"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
def test_the_block_write_kernel_writes_what_the_per_block_copies_write(cache_dtype):
    """engine/kernels/block_write.py's kernel (a GPU's admission path; here under Triton's interpreter, or
    compiled on a GPU machine) == write_sequence's per-block copies on the CPU, from a strided view
    of a projection's product as admission passes it: values, the last block's zeroed padding, and
    no write elsewhere."""
    from engine.kernels import triton_available
    from engine.kernels.block_write import triton_write_sequence

    if not triton_available():
        pytest.skip("triton is not installed")
    layers, frames, heads, head_dim, block_size = 3, 37, 2, 24, 8  # H x D = 48: not a power of two
    product = (
        torch.randn(frames, layers * 2 * heads * head_dim, generator=torch.Generator().manual_seed(1)) * 64
    )
    # Values on e4m3's grid: Triton's interpreter rounds into fp8 wrongly across a power of two
    # (124 -> 64); the compiled kernel's rounding == torch's was checked on an H100.
    product = product.to(FP8).float()
    product[5, 7], product[36, 100] = 1024.0, -3072.0  # beyond e4m3's range
    block_ids = [9, 2, 11, 0, 6]
    written = {}
    for role, device in (("copies", "cpu"), ("kernel", DEVICES[-1])):
        kv = product.to(device).view(frames, layers, 2, heads, head_dim).permute(1, 2, 0, 3, 4)
        storage = PagedKVStorage(12, layers, block_size, heads, head_dim, cache_dtype, torch.device(device))
        storage.cache.fill_(7.0)  # stale values: the padding must be zeroed, other blocks kept
        if role == "copies":
            storage.write_sequence(block_ids, kv)  # the per-block copies, on a CPU
            written["copies"] = storage.cache.float()
        else:
            triton_write_sequence(storage.cache, block_ids, kv)
            written["kernel"] = storage.cache.float().cpu()
    assert torch.equal(written["kernel"], written["copies"])
    assert (written["kernel"][[1, 3, 4, 5, 7, 8, 10, 12]] == 7.0).all(), (
        "a write landed outside the request's blocks"
    )
    filled = frames - 4 * block_size
    assert not written["kernel"][6, :, :, filled:].any(), "the last block's padding must be zero"
    assert written["kernel"][6, :, :, :filled].abs().min() > 0
    if cache_dtype == FP8:
        assert written["kernel"].abs().max() == 448.0
