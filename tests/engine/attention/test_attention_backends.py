"""Paged attention backends against a naive dense oracle and against the torch reference.

(a) TorchReferenceBackend == naive per-request dense attention (float64, loop over requests):
    validates the oracle every other backend is compared with.
(b) TritonPagedBackend == reference (and == the dense oracle), fp32 / fp16 / bf16.
(c) FlashAttnBackend == reference, only where flash_attn imports (CUDA); skipped elsewhere.
(d) An fp8 (e4m3) cache under an fp32 / fp16 / bf16 query: the reference upcasts it to the query's
    dtype, Triton to fp16 under a 16-bit query (a bf16 query saturated to fp16's range).
(e) The decoder's other Triton kernel, the residual add fused with the layer norm after it
    (engine/kernels/fused_norm.py), == the eager ops, and greedy decoding through it == transformers.

Triton on a machine without CUDA runs under its interpreter, TRITON_INTERPRET=1, which
tests/conftest.py sets before anything imports triton (triton's own library functions are
decorated at that import, our kernels lazily on first use). Without CUDA only: on a GPU machine
the same tests run the compiled kernels.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from engine.attention.base import PagedAttentionBatch
from engine.attention.flash_attn_backend import FlashAttnBackend, flash_attn_available
from engine.attention.registry import kv_cache_dtype_problem, make_attention_backend
from engine.attention.torch_ref import TorchReferenceBackend
from engine.attention.triton_paged import TritonPagedBackend, grouped_decode_heads
from engine.kernels import triton_available
from engine.kernels.fused_norm import triton_add_layer_norm
from engine.model.sublayers import add_layer_norm
from tests.support.hf_reference import jfk_tokens_beside_transformers
from tests.support.paths import REPO_ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N_LAYERS = 3
LAYER = 1  # a middle layer: its views are strided in dim 0 and offset from the storage start


class Case:
    """A random block-major cache [num_blocks, n_layers, 2, block_size, H, D] and one batch."""

    def __init__(
        self,
        *,
        q_lens: list[int],
        seq_lens: list[int],
        causal: bool,
        block_size: int,
        heads: int = 2,
        head_dim: int = 16,
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,  # None: the query's dtype
        seed: int = 0,
        garbage: float = 100.0,
        strided_query: bool = False,
        pad_value: int = -1,
    ) -> None:
        assert len(q_lens) == len(seq_lens)
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens, self.causal = q_lens, seq_lens, causal
        self.block_size, self.heads, self.head_dim, self.dtype = block_size, heads, head_dim, dtype
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 3  # a few blocks nobody owns
        cache = torch.randn(num_blocks, N_LAYERS, 2, block_size, heads, head_dim, generator=g)
        # shuffled, non-contiguous block ids per request; block 0 is owned by nobody (all
        # garbage), so a kernel that turns masked-off table entries into block 0 and then reads
        # it unmasked is caught too.
        perm = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
        self.tables: list[list[int]] = []
        for n in blocks_per_req:
            self.tables.append(perm[:n])
            perm = perm[n:]
        # slots that hold no key of anyone (tails of last blocks, unowned blocks) get garbage:
        # a backend that reads them unmasked gets a visibly wrong answer.
        valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for table, s in zip(self.tables, seq_lens):
            for p in range(s):
                valid[table[p // block_size], p % block_size] = True
        cache.permute(0, 3, 1, 2, 4, 5)[~valid] = garbage  # [blocks, slot, layer, k/v, H, D] view
        self.cache = cache.to(cache_dtype or dtype).to(DEVICE)

        max_blocks = max(blocks_per_req) + 2  # padding columns past every request's blocks
        bt = torch.full((len(q_lens), max_blocks), pad_value, dtype=torch.int32)
        for i, table in enumerate(self.tables):
            bt[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.batch = PagedAttentionBatch(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=bt.to(DEVICE),
            causal=causal,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        total = starts[-1]
        if strided_query:  # like q from qkv.view(T, 3, H, D).unbind(1): token stride 3*H*D
            qkv = torch.randn(total, 3, heads, head_dim, generator=g).to(dtype).to(DEVICE)
            self.query = qkv[:, 0]
        else:
            self.query = torch.randn(total, heads, head_dim, generator=g).to(dtype).to(DEVICE)
        self.scale = head_dim**-0.5

    @property
    def key_cache(self) -> torch.Tensor:
        return self.cache[:, LAYER, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.cache[:, LAYER, 1]

    def run(self, backend) -> torch.Tensor:
        return backend.paged_attention(self.query, self.key_cache, self.value_cache, self.batch, self.scale)

    def dense(self) -> torch.Tensor:
        """Naive oracle: per request, gather its keys position by position, float64 softmax."""
        out = torch.empty(self.query.shape, dtype=torch.float64)
        q_all = self.query.double().cpu()
        kc, vc = self.key_cache.double().cpu(), self.value_cache.double().cpu()
        start = 0
        for table, q_len, s in zip(self.tables, self.q_lens, self.seq_lens):
            q = q_all[start : start + q_len]  # [q, H, D]
            blocks = torch.tensor([table[p // self.block_size] for p in range(s)])
            slots = torch.arange(s) % self.block_size
            k, v = kc[blocks, slots], vc[blocks, slots]  # [s, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if self.causal:
                q_pos = s - q_len + torch.arange(q_len)
                allowed = torch.arange(s)[None, :] <= q_pos[:, None]
                scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            start += q_len
        return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# name: (q_lens, seq_lens, causal, block_size, head_dim)
SHAPES = {
    "cross_decode_bs16": ([1, 1, 1], [1500, 1500, 1500], False, 16, 32),
    "cross_decode_bs1": ([1, 1], [1500, 1500], False, 1, 16),
    "cross_mixed_bs32": ([3, 1, 20], [1500, 1500, 1500], False, 32, 16),
    "self_decode_bs8": ([1, 1, 1, 1], [1, 7, 33, 130], True, 8, 32),
    "self_decode_bs1": ([1, 1, 1], [1, 5, 19], True, 1, 16),
    "self_prefill_bs16": ([37], [37], True, 16, 16),
    "self_mixed_bs8": ([5, 1, 23, 1, 4], [5, 40, 60, 3, 29], True, 8, 32),
    "self_mixed_bs32_d20": ([17, 1, 2], [17, 100, 70], True, 32, 20),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_reading_the_same_cross_attention_blocks_as_a_windows_beams_do_match_the_oracle(backend):
    """A window's beams read one copy of its cross-attention K/V: rows 0, 2, 3 share one table and
    rows 1, 4 another (the reference backend then gathers each table once for its readers)."""
    if backend == "triton" and not triton_available():
        pytest.skip("needs triton")
    case = Case(q_lens=[1] * 5, seq_lens=[1500] * 5, causal=False, block_size=16, head_dim=16)
    readers_of = [0, 1, 0, 0, 1]
    case.tables = [case.tables[owner] for owner in readers_of]
    case.batch.block_tables.copy_(case.batch.block_tables[readers_of])
    chosen = TorchReferenceBackend() if backend == "torch" else TritonPagedBackend()
    assert_close(case.run(chosen), case.dense(), torch.float32)


@pytest.mark.parametrize("name", list(SHAPES))
def test_reference_matches_dense_oracle(name):
    q_lens, seq_lens, causal, bs, d = SHAPES[name]
    case = Case(q_lens=q_lens, seq_lens=seq_lens, causal=causal, block_size=bs, head_dim=d, seed=1)
    out = case.run(TorchReferenceBackend())
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.double().cpu(), case.dense(), atol=1e-5, rtol=1e-5)


def test_reference_matches_dense_oracle_fp16():
    case = Case(
        q_lens=[5, 1, 9], seq_lens=[5, 30, 44], causal=True, block_size=8, dtype=torch.float16, seed=2
    )
    assert_close(case.run(TorchReferenceBackend()), case.dense(), torch.float16)


needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference_fp32(name, num_splits):
    q_lens, seq_lens, causal, bs, d = SHAPES[name]
    case = Case(q_lens=q_lens, seq_lens=seq_lens, causal=causal, block_size=bs, head_dim=d, seed=3)
    out = case.run(TritonPagedBackend(num_splits=num_splits))
    assert out.shape == case.query.shape and out.dtype == torch.float32
    assert_close(out, case.run(TorchReferenceBackend()), torch.float32)
    assert_close(out, case.dense(), torch.float32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "name,num_splits",
    [("cross_decode_bs16", 2), ("self_decode_bs8", None), ("self_mixed_bs8", None), ("cross_mixed_bs32", 2)],
)
def test_triton_matches_reference_half(name, num_splits, dtype):
    q_lens, seq_lens, causal, bs, d = SHAPES[name]
    case = Case(
        q_lens=q_lens, seq_lens=seq_lens, causal=causal, block_size=bs, head_dim=d, dtype=dtype, seed=4
    )
    out = case.run(TritonPagedBackend(num_splits=num_splits))
    assert out.dtype == dtype
    assert_close(out, case.run(TorchReferenceBackend()), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_upcasts_an_fp8_cache_to_the_query_dtype(dtype):
    case = Case(
        q_lens=[3, 1],
        seq_lens=[20, 45],
        causal=True,
        block_size=8,
        dtype=dtype,
        cache_dtype=torch.float8_e4m3fn,
        seed=6,
    )
    out = case.run(TorchReferenceBackend())
    assert out.dtype == dtype
    assert_close(out, case.dense(), dtype)  # the oracle reads the same fp8 values, in float64


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,num_splits", [("cross_decode_bs16", 2), ("self_mixed_bs8", None)])
def test_triton_reads_an_fp8_cache_in_the_query_dtype(name, num_splits, dtype):
    """Triton's CPU interpreter runs an fp8 cache too (it loads e4m3 and upcasts as a GPU does);
    the output comes back in the query's dtype."""
    q_lens, seq_lens, causal, bs, d = SHAPES[name]
    case = Case(
        q_lens=q_lens,
        seq_lens=seq_lens,
        causal=causal,
        block_size=bs,
        head_dim=d,
        dtype=dtype,
        cache_dtype=torch.float8_e4m3fn,
        seed=7,
    )
    out = case.run(TritonPagedBackend(num_splits=num_splits))
    assert out.dtype == dtype
    assert_close(out, case.run(TorchReferenceBackend()), dtype)
    assert_close(out, case.dense(), dtype)


@needs_triton
def test_triton_saturates_a_bf16_query_beyond_fp16_range_over_an_fp8_cache():
    """Over an fp8 cache a bf16 query is computed in fp16: a query past fp16's range (65504) must
    saturate, not turn into inf and then NaN scores."""
    case = Case(
        q_lens=[1, 1],
        seq_lens=[40, 17],
        causal=False,
        block_size=8,
        dtype=torch.bfloat16,
        cache_dtype=torch.float8_e4m3fn,
        seed=8,
    )
    case.query.mul_(1e5)
    out = case.run(TritonPagedBackend())
    assert torch.isfinite(out.float()).all()
    case.query.clamp_(-65504, 65504)  # what saturation means: the clamped query's attention
    assert_close(out, case.run(TorchReferenceBackend()), torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
def test_triton_never_reads_unowned_slots(causal):
    """NaN in every slot no request owns and an out-of-range padding id in the block table:
    masked loads must never touch them (the torch reference would turn NaN into NaN, so the
    dense oracle is the comparison here)."""
    case = Case(
        q_lens=[1, 4, 1],
        seq_lens=[21, 13, 30],
        causal=causal,
        block_size=8,
        garbage=float("nan"),
        pad_value=10**6,
        strided_query=True,
    )
    out = case.run(TritonPagedBackend(num_splits=2, prefill_block_n=16))
    assert_close(out, case.dense(), torch.float32)


@needs_triton
def test_triton_strided_query_and_small_tiles():
    case = Case(
        q_lens=[3, 1, 18],
        seq_lens=[40, 9, 18],
        causal=True,
        block_size=4,
        head_dim=32,
        strided_query=True,
        seed=5,
    )
    backend = TritonPagedBackend(decode_block_n=16, prefill_block_m=16, prefill_block_n=16, num_splits=2)
    assert_close(case.run(backend), case.run(TorchReferenceBackend()), torch.float32)


@needs_triton
@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.float32, None), (torch.float16, None), (torch.bfloat16, torch.float8_e4m3fn)]
)
@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("causal,seq_lens", [(False, [300, 300, 300]), (True, [1, 17, 130])])
def test_grouped_decode_kernel_reads_several_heads_per_program(
    dtype, cache_dtype, num_splits, causal, seq_lens
):
    """A decode step's heads in groups of 4 (12 heads: 3 groups, so a group's columns start
    mid-row), with and without key splits, as cross- and self-attention, matches the reference
    and the one-head-per-program kernel."""
    case = Case(
        q_lens=[1] * 3,
        seq_lens=seq_lens,
        causal=causal,
        block_size=16,
        heads=12,
        head_dim=16,
        dtype=dtype,
        cache_dtype=cache_dtype,
        seed=9,
        strided_query=True,
    )
    grouped = TritonPagedBackend(num_splits=num_splits)
    plan = grouped.plan(case.batch, 12, DEVICE, case.cache.dtype, 16)
    assert plan.heads_per_program == 4
    out = case.run(grouped)
    assert_close(out, case.run(TorchReferenceBackend()), dtype)
    assert_close(out, case.run(TritonPagedBackend(num_splits=num_splits, decode_heads_per_program=1)), dtype)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_grouped_decode_kernel_reads_a_shared_table_once_for_all_its_readers(dtype, num_splits):
    """Cross-attention of beams: rows 0-3 read one table, row 4 its own, rows 5-6 another, row 7
    its own; ``key_readers`` says so, and each group's first program serves the group's queries
    (4 heads per program: up to 4 readers in its 16-row tile). The outputs match the oracle and
    the same batch without the hint; and the readers' own table rows are not read: pointed
    elsewhere, the answer stays."""
    owners = [0, 0, 0, 0, 4, 5, 5, 7]
    case = Case(
        q_lens=[1] * 8,
        seq_lens=[300] * 8,
        causal=False,
        block_size=16,
        heads=12,
        head_dim=16,
        dtype=dtype,
        seed=4,
        strided_query=True,
    )
    case.tables = [case.tables[owner] for owner in owners]
    case.batch.block_tables.copy_(case.batch.block_tables[owners])
    backend = TritonPagedBackend(num_splits=num_splits)
    assert backend.max_key_readers(12, 16) == 4
    alone = case.run(backend)
    case.batch.key_readers = torch.tensor([4, 0, 0, 0, 1, 2, 0, 1], dtype=torch.int32, device=DEVICE)
    case.batch.block_tables[[1, 2, 3, 6]] = case.batch.block_tables[7].clone()  # served by their group
    shared = case.run(backend)
    assert_close(shared, case.dense(), dtype)
    assert_close(shared, alone, dtype)


def test_grouped_decode_heads_divide_the_heads_within_one_row_of_keys():
    assert grouped_decode_heads(20, 64) == 2  # large-v3: 10 groups of 2 heads, 128 keys' columns
    assert grouped_decode_heads(6, 64) == 2  # tiny
    assert grouped_decode_heads(12, 16) == 4
    assert grouped_decode_heads(5, 64) == 1
    assert grouped_decode_heads(8, 20) == 1  # head_dim not a power of two: one head per program


@needs_triton
def test_decode_with_a_head_dim_not_a_power_of_two_runs_one_head_per_program():
    case = Case(q_lens=[1, 1], seq_lens=[40, 200], causal=False, block_size=16, heads=4, head_dim=20, seed=10)
    backend = TritonPagedBackend()
    assert backend.plan(case.batch, 4, DEVICE, case.cache.dtype, 20).heads_per_program == 1
    assert_close(case.run(backend), case.dense(), torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        TritonPagedBackend(decode_heads_per_program=2).plan(case.batch, 4, DEVICE, case.cache.dtype, 20)


@needs_triton
def test_triton_plan_split_k_heuristic():
    backend = TritonPagedBackend()
    batch = Case(q_lens=[1] * 2, seq_lens=[1500] * 2, causal=False, block_size=16).batch
    plan = backend.plan(batch, num_heads=2, device=torch.device("cpu"))
    assert plan.block_m == 16 and plan.num_q_tiles == 1  # one padded tensor-core tile per request
    assert plan.num_splits * plan.keys_per_split >= 1500
    assert plan.keys_per_split % plan.block_n == 0
    forced = TritonPagedBackend(num_splits=5).plan(batch, num_heads=2, device=torch.device("cpu"))
    assert forced.num_splits == 5 and (forced.num_splits - 1) * forced.keys_per_split < 1500


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_refuses_cpu_without_interpreter(monkeypatch):
    case = Case(q_lens=[1], seq_lens=[5], causal=True, block_size=8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        case.run(TritonPagedBackend())


def test_registry():
    cpu = torch.device("cpu")
    assert isinstance(make_attention_backend("torch", cpu), TorchReferenceBackend)
    assert make_attention_backend("auto", cpu).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("nope", cpu)
    with pytest.raises(ValueError, match="flash"):
        make_attention_backend("flash_attn", cpu)
    if triton_available():
        assert make_attention_backend("triton", DEVICE).name == "triton"


def test_flash_attn_is_refused_an_fp8_cache_and_auto_passes_it_over():
    assert "fp8" in kv_cache_dtype_problem("flash_attn", torch.float8_e4m3fn)
    for name in ("auto", "torch", "triton"):
        assert kv_cache_dtype_problem(name, torch.float8_e4m3fn) is None
    assert kv_cache_dtype_problem("flash_attn", torch.bfloat16) is None
    if flash_attn_available() and torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp8"):
            make_attention_backend("flash_attn", DEVICE, block_size=256, dtype=torch.float8_e4m3fn)
        assert (
            make_attention_backend("auto", DEVICE, block_size=256, dtype=torch.float8_e4m3fn).name
            != "flash_attn"
        )


def test_registry_triton_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):
        make_attention_backend("triton", torch.device("cpu"))


def test_a_failed_optional_import_keeps_no_caller_frames_alive():
    """flash_attn_backend is first imported inside whatever asks the registry first: on a GPU,
    DecoderEngine.__init__. Where flash-attn is missing, the module keeps why; it kept the
    ImportError itself, whose traceback held the importing frames and through them the engine
    being built, with its KV pool (40 GB left allocated on the H100 after the engine was gone).
    A fresh interpreter, so that this import is the module's first."""
    code = textwrap.dedent("""
        import gc, weakref

        class KVPool:
            pass

        def build_engine():
            pool = KVPool()
            import engine.attention.flash_attn_backend
            return weakref.ref(pool)

        pool = build_engine()
        gc.collect()
        print("alive" if pool() is not None else "freed")
    """)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "freed"


def test_flash_attn_block_size_rule():
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttnBackend(block_size=16)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (flash_attn_available() and torch.cuda.is_available()), reason="needs flash_attn and CUDA"
)
@pytest.mark.parametrize("name", ["cross_decode", "cross_mixed", "self_decode", "self_mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_matches_reference(name, dtype):
    pytest.importorskip("flash_attn")
    shapes = {
        "cross_decode": ([1, 1, 1], [1500, 1500, 1500], False),
        "cross_mixed": ([3, 1, 20], [1500, 1500, 1500], False),
        "self_decode": ([1, 1, 1, 1], [1, 7, 300, 448], True),
        "self_mixed": ([5, 1, 23, 1], [5, 400, 60, 3], True),
    }
    q_lens, seq_lens, causal = shapes[name]
    case = Case(
        q_lens=q_lens,
        seq_lens=seq_lens,
        causal=causal,
        block_size=256,
        heads=4,
        head_dim=64,
        dtype=dtype,
        strided_query=True,
    )
    out = case.run(FlashAttnBackend(block_size=256))
    assert_close(out, case.run(TorchReferenceBackend()), dtype)


def test_fused_residual_norm_matches_eager():
    """engine.kernels.fused_norm's kernel == the eager add + layer norm, on ragged widths too."""
    generator = torch.Generator().manual_seed(0)
    for rows, cols in ((1, 64), (5, 100), (3, 384)):
        x, delta = (torch.randn(2, rows, cols, generator=generator) * 3).to(DEVICE)
        weight, bias = torch.randn(2, cols, generator=generator).to(DEVICE)
        fused_sum, fused_norm = triton_add_layer_norm(x, delta, weight, bias, 1e-5)
        eager_sum, eager_norm = add_layer_norm(x, delta, weight, bias, 1e-5)
        assert torch.equal(fused_sum, eager_sum)
        torch.testing.assert_close(fused_norm, eager_norm, rtol=1e-5, atol=1e-5)


def test_fused_residual_norms_decode_the_same_tokens_as_transformers(random_whisper_folder):
    """The decoder with engine.fused_decoder_norms' kernel stays token-exact with transformers."""

    def fuse(decoder):
        decoder.fuse_residual_norms()
        assert decoder.sublayers.add_norm is triton_add_layer_norm

    ours, theirs = jfk_tokens_beside_transformers(random_whisper_folder, DEVICE, fuse, max_tokens=40)
    assert len(ours) > 0
    assert ours == theirs
