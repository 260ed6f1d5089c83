"""The decoder's products at a decode step's few rows through engine/kernels/small_products.py
(``engine.gpu.small_rows_products``): the kernel against the dense product, which rows and widths
it takes, and a decoder that runs every product through it decoding transformers' tokens. On a CPU
the kernel runs under Triton's interpreter (tests/conftest.py), without the launch control; the GPU
test runs it captured in a CUDA graph behind the fused residual norm, as a decode step does. Its
speed is in benchmarks/RESULTS.md."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from engine.kernels import triton_available
from engine.kernels.fused_norm import triton_add_layer_norm
from engine.kernels.small_products import small_rows_product, supports, triton_small_rows_linear
from engine.model.whisper import dense_product
from tests.support.hf_reference import jfk_tokens_beside_transformers

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton (its interpreter on a CPU)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def linear_layer(k: int, n: int, bias: bool, seed: int, device=DEVICE, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(device, dtype)


@pytest.mark.parametrize(
    "rows,k,n,bias,gelu",
    [
        (1, 96, 40, True, False),
        (2, 64, 100, False, True),
        (5, 384, 24, True, True),
        (16, 96, 70, True, False),
        (3, 64, 33, False, False),
    ],
)
def test_the_small_rows_kernel_computes_the_dense_product(rows, k, n, bias, gelu):
    """Both kernels (sums on CUDA cores up to two rows, the tensor-core tile up to 16), input widths of
    one power of two (64) and of two (96 = 64 + 32, 384 = 256 + 128), output widths that are no
    multiple of a program's rows, with and without a bias, and fc1's exact GELU."""
    linear = linear_layer(k, n, bias, seed=rows)
    x = torch.randn(rows, k, device=DEVICE) * 2
    with torch.no_grad():
        expected = dense_product(x, linear, gelu)
        got = triton_small_rows_linear(x, linear.weight, linear.bias, gelu)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_products_of_more_rows_or_of_another_width_go_to_the_dense_product():
    calls = []

    def dense(x, linear, gelu=False):
        calls.append(x.shape[0])
        return dense_product(x, linear, gelu)

    linear = linear_layer(64, 32, True, seed=0)
    wide = linear_layer(4096, 8, True, seed=2)  # 32 whole rows of it would not fit a tile program
    with torch.no_grad():
        for rows in (1, 2, 3):
            small_rows_product(torch.randn(rows, 64, device=DEVICE), linear, max_rows=2, otherwise=dense)
        for rows in (16, 17):
            small_rows_product(torch.randn(rows, 64, device=DEVICE), linear, max_rows=32, otherwise=dense)
        for rows in (2, 3):
            small_rows_product(torch.randn(rows, 4096, device=DEVICE), wide, max_rows=16, otherwise=dense)
        odd = linear_layer(100, 32, True, seed=1)  # 100 = 64 + 36: not two powers of two
        assert not supports(torch.randn(1, 100, device=DEVICE), odd.weight)
        out = small_rows_product(torch.randn(1, 100, device=DEVICE), odd, max_rows=2, otherwise=dense)
    assert calls == [3, 17, 3, 1]
    assert out.shape == (1, 32)


def test_a_decoder_with_every_product_through_the_kernel_decodes_transformers_tokens(random_whisper_folder):
    def through_the_kernel(decoder):
        for layer in decoder.layers:
            # Column-major on a CPU (store_widening_weights_column_major); row-major, as on a GPU,
            # for the kernel to take them.
            for linear in (layer.self_qkv, layer.mlp.fc1):
                linear.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)

        def past_the_kernel(x, linear, gelu=False):
            raise AssertionError(f"a product of {x.shape[0]} rows went past the kernel")

        decoder.product = functools.partial(small_rows_product, max_rows=4, otherwise=past_the_kernel)

    ours, theirs = jfk_tokens_beside_transformers(
        random_whisper_folder, DEVICE, through_the_kernel, max_tokens=8
    )
    assert len(ours) > 0
    assert ours == theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_on_the_gpu_products_behind_the_fused_norm_in_a_cuda_graph_match_the_dense_ones(rows):
    """large-v3's widths, fp16: residual norm -> QKV-wide product -> fc1 with GELU -> fc2 (cuBLAS's
    past two rows), the kernels' products launched to overlap the kernel before them, replayed from a
    CUDA graph after the input changed, against the same chain through cuBLAS."""
    device, dtype = torch.device("cuda"), torch.float16
    qkv, fc1, fc2 = (
        linear_layer(k, n, True, s, device, dtype)
        for s, (k, n) in enumerate([(1280, 3840), (1280, 5120), (5120, 1280)])
    )
    norm_weight, norm_bias = torch.randn(2, 1280, device=device, dtype=dtype)
    x, delta = torch.randn(2, rows, 1280, device=device, dtype=dtype)

    def chain(product):
        _, h = triton_add_layer_norm(x, delta, norm_weight, norm_bias, 1e-5)
        wide = product(h, qkv)
        return wide, product(product(h, fc1, True), fc2)

    def small(h, linear, gelu=False):
        return small_rows_product(h, linear, gelu, max_rows=16, otherwise=dense_product)

    with torch.inference_mode():
        chain(small)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wide, out = chain(small)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected_wide, expected = chain(dense_product)
    torch.testing.assert_close(wide, expected_wide, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
