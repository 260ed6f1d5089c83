"""The decoder's products at a decode step's few rows through engine/kernels/small_products.py
(``engine.gpu.small_rows_products``): the kernel against the dense product, and a QKV product's
keys and values stored in their cache slots as the dense path's indexed write puts them; which
products go the dense way instead (engine/model/sublayers.py); and a decoder that runs every
product through it decoding transformers' tokens. On a CPU the kernel runs under Triton's interpreter
(tests/conftest.py), without the launch control; the GPU test runs a layer's chain captured in a
CUDA graph, as a decode step does. Its speed is in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import triton_available
from engine.kernels.fused_norm import triton_add_layer_norm
from engine.kernels.small_products import FoldedNorm, KVSlots, folds_norm, supports, triton_small_rows_linear
from engine.model.sublayers import SmallRowsSublayers, Sublayers, dense_product
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
        (5, 3072, 70, True, True),
        (16, 4096, 40, True, False),
    ],
)
def test_the_small_rows_kernel_computes_the_dense_product(rows, k, n, bias, gelu):
    """Both kernels (sums on CUDA cores at one row, the tensor-core tile up to 16 rows), input widths of
    one power of two (64) and of two (96 = 64 + 32, 384 = 256 + 128), inputs too wide for a tile
    program split in parts (3072, 4096; twice, so the parts' counters are back at zero after a
    product), output widths that are no multiple of a program's rows, with and without a bias, and
    fc1's exact GELU."""
    linear = linear_layer(k, n, bias, seed=rows)
    x = torch.randn(rows, k, device=DEVICE) * 2
    with torch.no_grad():
        expected = dense_product(x, linear, gelu)
        got = triton_small_rows_linear(x, linear.weight, linear.bias, gelu)
        again = triton_small_rows_linear(x, linear.weight, linear.bias, gelu)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, got)


def layer_norm(width: int, seed: int, device=DEVICE, dtype=torch.float32) -> nn.LayerNorm:
    torch.manual_seed(seed)
    norm = nn.LayerNorm(width).to(device, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    return norm


@pytest.mark.parametrize(
    "k,n,bias,gelu,with_kv",
    [(96, 40, True, False, False), (384, 24, False, True, False), (64, 3 * 64, True, False, True)],
)
def test_a_residual_add_and_norm_fold_into_a_one_row_product(k, n, bias, gelu, with_kv):
    """At one row the kernel takes ``layer_norm(x + delta)`` whole: it returns the sum, as the add
    leaves it, and the product of the normed sum, as the add, the norm and the product one after the
    other give them, for input widths of one and of two powers of two, with and without a bias, with
    the GELU, and for a QKV product storing its keys and values. The row sits far from zero, as a
    residual stream may, against a one-pass variance's cancellation."""
    linear = linear_layer(k, n, bias, seed=k)
    norm = layer_norm(k, seed=n)
    x = torch.randn(1, k, device=DEVICE) * 3 + 20
    delta = torch.randn(1, k, device=DEVICE)
    small = SmallRowsSublayers(otherwise=Sublayers(), folded={linear: FoldedNorm.of(norm, linear)})
    heads, head_dim = 4, 16
    if with_kv:
        whole, layer = kv_layout(heads=heads, head_dim=head_dim)
        expected_whole, expected_layer = kv_layout(heads=heads, head_dim=head_dim)
    block_ids, offsets = torch.tensor([5], device=DEVICE), torch.tensor([2], device=DEVICE)
    slots, expected_slots = (
        (KVSlots(layer, block_ids, offsets), KVSlots(expected_layer, block_ids, offsets))
        if with_kv
        else (None, None)
    )
    assert folds_norm(x, delta, linear.weight)
    with torch.no_grad():
        total, got = small.add_norm_product(x, delta, norm, linear, gelu, slots)
        expected_total, expected = Sublayers().add_norm_product(x, delta, norm, linear, gelu, expected_slots)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if with_kv:
        written = ~torch.isnan(whole)
        assert torch.equal(written, ~torch.isnan(expected_whole)) and written.sum() == 2 * heads * head_dim
        torch.testing.assert_close(whole[written], expected_whole[written], rtol=1e-4, atol=1e-4)


def test_past_one_row_the_add_and_norm_stay_a_kernel_of_their_own():
    """Two rows: the add and norm go ``otherwise``'s way, and the product then through the tile."""
    norms = []

    def add_norm(x, delta, weight, bias, eps):
        norms.append(x.shape[0])
        return Sublayers().add_norm(x, delta, weight, bias, eps)

    linear, norm = linear_layer(64, 32, True, seed=0), layer_norm(64, seed=1)
    small = SmallRowsSublayers(
        otherwise=Sublayers(add_norm=add_norm), folded={linear: FoldedNorm.of(norm, linear)}
    )
    x, delta = torch.randn(2, 2, 64, device=DEVICE)
    assert not folds_norm(x, delta, linear.weight)
    with torch.no_grad():
        total, got = small.add_norm_product(x, delta, norm, linear)
        expected_total, expected = Sublayers().add_norm_product(x, delta, norm, linear)
    assert norms == [2]
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def kv_layout(blocks=6, layers=3, block_size=4, heads=2, head_dim=16, device=DEVICE, dtype=torch.float32):
    """A whole cache [blocks, layers, 2, block_size, H, D] of NaNs, and its layer 1 as the decoder sees it."""
    cache = torch.full(
        (blocks, layers, 2, block_size, heads, head_dim), float("nan"), device=device, dtype=dtype
    )
    return cache, cache[:, 1]


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_qkv_product_stores_its_keys_and_values_in_their_cache_slots(rows):
    """Queries come back; keys and values land in each row's (block, offset) of the layer's strided
    cache view and nowhere else, as the dense path's indexed write puts them."""
    heads, head_dim = 2, 16
    d_model = heads * head_dim
    qkv = linear_layer(d_model, 3 * d_model, True, seed=rows)
    x = torch.randn(rows, d_model, device=DEVICE)
    block_ids = torch.tensor([4, 0, 4, 2, 5][:rows], device=DEVICE)
    offsets = torch.tensor([3, 0, 1, 2, 3][:rows], device=DEVICE)
    whole, layer = kv_layout(heads=heads, head_dim=head_dim)
    expected_whole, expected_layer = kv_layout(heads=heads, head_dim=head_dim)
    with torch.no_grad():
        queries = triton_small_rows_linear(x, qkv.weight, qkv.bias, slots=KVSlots(layer, block_ids, offsets))
        expected_queries = Sublayers().queries_writing_kv(x, qkv, KVSlots(expected_layer, block_ids, offsets))
    torch.testing.assert_close(queries, expected_queries, rtol=1e-5, atol=1e-5)
    written = ~torch.isnan(whole)
    assert torch.equal(written, ~torch.isnan(expected_whole))
    assert written.sum() == rows * 2 * d_model
    torch.testing.assert_close(whole[written], expected_whole[written], rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_goes_the_dense_way():
    """Past 16 rows; an input past one row too wide for a tile program and not in whole parts of
    1024 (4608); an input width that is not two powers of two; and a K/V write into a cache of
    another dtype (fp8's saturating cast): its product still through the kernel, its write the
    dense path's."""
    calls = []

    def dense(x, linear, gelu=False):
        calls.append((x.shape[0], linear.in_features))
        return dense_product(x, linear, gelu)

    small = SmallRowsSublayers(otherwise=Sublayers(product=dense))
    linear = linear_layer(64, 32, True, seed=0)
    wide = linear_layer(4608, 8, True, seed=2)  # 4096 + 512: on CUDA cores, but no tile nor parts
    odd = linear_layer(100, 32, True, seed=1)  # 100 = 64 + 36: not two powers of two
    qkv = linear_layer(64, 192, True, seed=3)
    with torch.no_grad():
        for rows in (1, 16, 17):
            small.product(torch.randn(rows, 64, device=DEVICE), linear)
        for rows in (1, 2):
            small.product(torch.randn(rows, 4608, device=DEVICE), wide)
        assert not supports(torch.randn(1, 100, device=DEVICE), odd.weight)
        out = small.product(torch.randn(1, 100, device=DEVICE), odd)
        _, layer = kv_layout(heads=4, head_dim=16, dtype=torch.float16)
        slots = KVSlots(layer, torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE))
        queries = small.queries_writing_kv(torch.randn(1, 64, device=DEVICE), qkv, slots)
    assert calls == [(17, 64), (2, 4608), (1, 100)]
    assert out.shape == (1, 32) and queries.shape == (1, 64)
    assert not torch.isnan(layer[0, :, 1]).any()  # the dense path's write


@pytest.mark.slow
def test_a_decoder_with_every_product_through_the_kernel_decodes_transformers_tokens(random_whisper_folder):
    def through_the_kernel(decoder):
        for layer in decoder.layers:
            # Column-major on a CPU (store_widening_weights_column_major); row-major, as on a GPU,
            # for the kernel to take them.
            for linear in (layer.self_qkv, layer.mlp.fc1):
                linear.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)

        def past_the_kernel(x, linear, gelu=False):
            raise AssertionError(f"a product of {x.shape[0]} rows went past the kernel")

        decoder.sublayers = Sublayers(product=past_the_kernel)
        decoder.use_small_rows_products(4)

    ours, theirs = jfk_tokens_beside_transformers(
        random_whisper_folder, DEVICE, through_the_kernel, max_tokens=8
    )
    assert len(ours) > 0
    assert ours == theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_on_the_gpu_a_layers_products_in_a_cuda_graph_match_the_dense_ones(rows):
    """large-v3's widths, fp16: residual add and norm -> QKV product writing its K/V, add and norm ->
    fc1 with GELU (at one row, each add and norm folded into the product's kernel) -> fc2 (in five
    parts past one row), the kernels launched to overlap the kernel before them, replayed from
    a CUDA graph after the input changed, against the same chain the dense way."""
    device, dtype = torch.device("cuda"), torch.float16
    qkv, fc1, fc2 = (
        linear_layer(k, n, True, s, device, dtype)
        for s, (k, n) in enumerate([(1280, 3840), (1280, 5120), (5120, 1280)])
    )
    norm = layer_norm(1280, seed=rows, device=device, dtype=dtype)
    x, delta = torch.randn(2, rows, 1280, device=device, dtype=dtype)
    block_ids = torch.arange(rows, device=device) // 4
    offsets = torch.arange(rows, device=device) % 4

    def chain(sublayers, layer):
        total, q = sublayers.add_norm_product(x, delta, norm, qkv, slots=KVSlots(layer, block_ids, offsets))
        _, hidden = sublayers.add_norm_product(total, delta, norm, fc1, gelu=True)
        return total, q, sublayers.product(hidden, fc2)

    whole, layer = kv_layout(blocks=4, block_size=4, heads=20, head_dim=64, device=device, dtype=dtype)
    expected_whole, expected_layer = kv_layout(
        blocks=4, block_size=4, heads=20, head_dim=64, device=device, dtype=dtype
    )
    fused_norm = Sublayers(add_norm=triton_add_layer_norm)
    small = SmallRowsSublayers(
        otherwise=fused_norm, folded={linear: FoldedNorm.of(norm, linear) for linear in (qkv, fc1)}
    )
    with torch.inference_mode():
        chain(small, layer)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(small, layer)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = chain(fused_norm, expected_layer)
    for ours, dense in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, dense, rtol=2e-2, atol=2e-2)
    written = ~torch.isnan(whole)
    assert torch.equal(written, ~torch.isnan(expected_whole))
    torch.testing.assert_close(whole[written], expected_whole[written], rtol=2e-2, atol=2e-2)
