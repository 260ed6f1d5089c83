"""The block pool's consecutive allocation (what a CPU's in-place cross-attention asks for): a run
of consecutive ids where one is free, any blocks where none is, never a block twice, and every block
back in the pool when its holders free them."""

from __future__ import annotations

import pytest

from engine.errors import CacheFullError
from engine.kv.block_pool import BlockPool


def is_run(block_ids: list[int]) -> bool:
    return block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids)))


def test_a_consecutive_allocation_takes_the_lowest_free_run():
    pool = BlockPool(20, block_size=16)
    held = pool.allocate(5)  # 0..4
    pool.free(held[1:3])  # 1, 2 free again: too short a run for 4
    assert pool.allocate_consecutive(4) == [5, 6, 7, 8]
    assert pool.allocate_consecutive(2) == [1, 2]


def test_a_run_freed_in_any_order_is_found_again():
    pool = BlockPool(30, block_size=16)
    first, second = pool.allocate_consecutive(12), pool.allocate_consecutive(12)
    pool.free(list(reversed(first)))
    assert pool.allocate_consecutive(12) == first
    assert not set(second) & set(first)


def test_without_a_free_run_it_hands_out_any_free_blocks_and_never_one_twice():
    pool = BlockPool(10, block_size=16)
    everything = pool.allocate(10)
    pool.free(everything[::2])  # 0, 2, 4, 6, 8: no two consecutive
    scattered = pool.allocate_consecutive(3)
    assert len(scattered) == 3 and not is_run(scattered)
    assert set(scattered) <= set(everything[::2])
    rest = pool.allocate(2)
    assert sorted(scattered + rest) == everything[::2]
    with pytest.raises(CacheFullError):
        pool.allocate_consecutive(1)


def test_every_block_returns_to_the_pool_after_mixed_allocations():
    pool = BlockPool(40, block_size=16)
    holders = []
    for count in (12, 3, 12, 1, 12):
        holders.append(pool.allocate_consecutive(count) if count == 12 else pool.allocate(count))
    assert all(is_run(ids) for ids in holders if len(ids) == 12)
    pool.free(holders.pop(2))
    holders.append(pool.allocate_consecutive(12))
    assert is_run(holders[-1])
    for ids in holders:
        pool.free(ids)
    assert pool.num_free_blocks == 40 and pool.num_used_blocks == 0
    assert sorted(pool.allocate(40)) == list(range(40))
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([3, 3])
