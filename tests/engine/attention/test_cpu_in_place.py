"""Cross-attention read in place on a CPU (engine/attention/cpu_in_place.py) against the gathered
reference (TorchReferenceBackend) and the dense oracle: block tables in one run of consecutive ids,
in many runs (shuffled ids), beams sharing a table, several queries a request, heads attended in
several block-diagonal products; self-attention left to the reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_in_place import CpuInPlaceBackend, heads_per_product
from engine.attention.registry import make_attention_backend
from engine.attention.torch_ref import TorchReferenceBackend
from engine.kv.block_pool import block_runs
from tests.engine.attention.test_attention_backends import SHAPES, Case, assert_close


def consecutive_tables(case: Case) -> None:
    """Give each request of ``case`` a run of consecutive block ids (the shuffled ids' blocks moved)."""
    first = 1  # block 0 stays nobody's
    for request, table in enumerate(case.tables):
        run = list(range(first, first + len(table)))
        case.cache[run] = case.cache[table].clone()
        case.tables[request] = run
        case.batch.block_tables[request, : len(run)] = torch.tensor(run, dtype=torch.int32)
        first += len(table)


def test_block_runs_are_the_maximal_runs_of_consecutive_ids_in_table_order():
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(5, 3), (2, 2), (9, 1)]
    assert block_runs([4]) == [(4, 1)]
    assert block_runs([3, 2, 1]) == [(3, 1), (2, 1), (1, 1)]


def test_heads_are_attended_in_groups_that_divide_their_number():
    assert [heads_per_product(h) for h in (1, 6, 8, 12, 16, 20)] == [1, 6, 4, 6, 4, 5]


@pytest.mark.parametrize("name", ["cross_decode_bs16", "cross_decode_bs1", "cross_mixed_bs32"])
@pytest.mark.parametrize("tables", ["shuffled", "consecutive"])
def test_in_place_cross_attention_equals_the_gathered_reference(name, tables):
    q_lens, seq_lens, causal, bs, d = SHAPES[name]
    case = Case(q_lens=q_lens, seq_lens=seq_lens, causal=causal, block_size=bs, head_dim=d, seed=11)
    if tables == "consecutive":
        consecutive_tables(case)
        assert all(len(block_runs(table)) == 1 for table in case.tables)
    out = case.run(CpuInPlaceBackend())
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    assert_close(out, case.run(TorchReferenceBackend()), torch.float32)
    assert_close(out, case.dense(), torch.float32)


def test_rows_sharing_a_table_as_beams_do_equal_the_oracle():
    case = Case(q_lens=[1] * 5, seq_lens=[1500] * 5, causal=False, block_size=128, head_dim=16, seed=12)
    consecutive_tables(case)
    readers_of = [0, 1, 0, 0, 1]
    case.tables = [case.tables[owner] for owner in readers_of]
    case.batch.block_tables.copy_(case.batch.block_tables[readers_of])
    assert_close(case.run(CpuInPlaceBackend()), case.dense(), torch.float32)


@pytest.mark.parametrize("heads", [10, 3])
def test_heads_in_several_products_equal_the_oracle(heads):
    """10 heads: two block-diagonal products of 5; 3 heads: one of 3."""
    case = Case(q_lens=[1, 2, 1], seq_lens=[300, 300, 77], causal=False, block_size=32, heads=heads, seed=13)
    assert_close(case.run(CpuInPlaceBackend()), case.dense(), torch.float32)


def test_in_bf16_it_stays_within_bf16_rounding_of_the_reference():
    case = Case(
        q_lens=[1, 1], seq_lens=[1500, 1500], causal=False, block_size=128, dtype=torch.bfloat16, seed=14
    )
    consecutive_tables(case)
    out = case.run(CpuInPlaceBackend())
    assert out.dtype == torch.bfloat16
    assert_close(out, case.run(TorchReferenceBackend()), torch.bfloat16)


def test_self_attention_and_an_fp8_cache_go_through_the_reference_unchanged():
    backend, reference = CpuInPlaceBackend(), TorchReferenceBackend()
    causal = Case(q_lens=[5, 1, 23], seq_lens=[5, 40, 60], causal=True, block_size=8, seed=15)
    assert torch.equal(causal.run(backend), causal.run(reference))
    fp8 = Case(
        q_lens=[1, 1], seq_lens=[40, 17], causal=False, block_size=8, cache_dtype=torch.float8_e4m3fn, seed=16
    )
    assert torch.equal(fp8.run(backend), fp8.run(reference))


def test_a_new_step_is_planned_anew_and_every_layer_of_one_step_reads_the_same_plan():
    backend = CpuInPlaceBackend()
    first = Case(q_lens=[1, 1], seq_lens=[300, 200], causal=False, block_size=32, seed=17)
    second = Case(q_lens=[1, 1, 1], seq_lens=[100, 300, 64], causal=False, block_size=32, seed=18)
    assert_close(first.run(backend), first.dense(), torch.float32)
    assert_close(first.run(backend), first.dense(), torch.float32)  # the next layer, same batch
    assert_close(second.run(backend), second.dense(), torch.float32)


def test_on_a_cpu_the_torch_backend_reads_in_place_and_asks_for_consecutive_blocks():
    backend = make_attention_backend("torch", torch.device("cpu"))
    assert isinstance(backend, CpuInPlaceBackend) and backend.prefers_consecutive_blocks
    assert not TorchReferenceBackend.prefers_consecutive_blocks


def test_the_engine_on_a_cpu_allocates_cross_blocks_as_runs_for_it(tiny_en):
    from engine.decode.engine import DecoderEngine

    engine = DecoderEngine(tiny_en)
    assert isinstance(engine.runner.backend, CpuInPlaceBackend)
    assert engine.scheduler.consecutive_cross_blocks
