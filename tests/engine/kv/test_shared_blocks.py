"""Self-attention blocks shared by a window's beam hypotheses: forks share, a write into a shared
block copies exactly that block, and blocks nobody holds return to the window's spares."""

from __future__ import annotations

import pytest
import torch

from engine.kv.shared_blocks import BlockCopy, SharedBlocks
from engine.kv.storage import PagedKVStorage

BLOCK = 4


def test_a_table_grows_into_fresh_blocks_without_copying():
    blocks = SharedBlocks([10, 11, 12, 13], BLOCK)
    table: list[int] = []
    assert blocks.prepare_write(table, 0, 6) == []  # a six-token prompt: two fresh blocks
    assert table == [10, 11] and blocks.num_spare == 2


def test_a_fork_shares_every_block_and_a_write_inside_a_shared_block_copies_exactly_that_block():
    blocks = SharedBlocks(list(range(10, 20)), BLOCK)
    parent: list[int] = []
    blocks.prepare_write(parent, 0, 6)  # positions 0..5: block 10 full, block 11 half
    child = blocks.fork(parent)
    assert child == parent and blocks.ref_count(10) == 2 and blocks.ref_count(11) == 2

    copies = blocks.prepare_write(child, 6, 7)  # the child writes position 6, inside shared block 11
    assert copies == [BlockCopy(source=11, target=12)]
    assert child == [10, 12] and parent == [10, 11]
    assert blocks.ref_count(10) == 2 and blocks.ref_count(11) == 1 and blocks.ref_count(12) == 1
    # The parent now holds block 11 alone: its own write there copies nothing.
    assert blocks.prepare_write(parent, 6, 7) == []


def test_a_write_that_starts_a_new_block_takes_a_spare_and_shares_the_full_ones():
    blocks = SharedBlocks(list(range(10, 20)), BLOCK)
    parent: list[int] = []
    blocks.prepare_write(parent, 0, 4)  # exactly one full block
    child = blocks.fork(parent)
    assert blocks.prepare_write(child, 4, 5) == []  # position 4 opens block index 1: fresh, no copy
    assert child == [10, 11] and blocks.ref_count(10) == 2


def test_blocks_nobody_holds_go_back_to_the_windows_spares_not_the_pool():
    blocks = SharedBlocks([10, 11, 12], BLOCK)
    table: list[int] = []
    blocks.prepare_write(table, 0, 5)
    child = blocks.fork(table)
    blocks.drop(table)
    assert blocks.num_spare == 1 and blocks.ref_count(10) == 1
    blocks.drop(child)
    assert blocks.num_spare == 3 and blocks.ref_count(10) == 0


def test_using_more_blocks_than_reserved_is_an_error_not_a_silent_overwrite():
    blocks = SharedBlocks([10], BLOCK)
    with pytest.raises(RuntimeError, match="more self-attention blocks than it reserved"):
        blocks.prepare_write([], 0, 5)


def test_the_storage_copies_whole_blocks_across_every_layer_and_leaves_the_rest():
    storage = PagedKVStorage(6, 2, BLOCK, 2, 3, torch.float32, torch.device("cpu"))
    storage.cache.copy_(torch.randn_like(storage.cache))
    before = storage.cache.clone()
    storage.copy_blocks([BlockCopy(1, 4), BlockCopy(2, 5)])
    assert torch.equal(storage.cache[4], before[1]) and torch.equal(storage.cache[5], before[2])
    untouched = [0, 1, 2, 3, 6]
    assert torch.equal(storage.cache[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_the_triton_block_copy_moves_whole_blocks_in_every_cache_dtype(dtype):
    """engine/kernels/block_copy.py's kernel (the GPU's path; here under Triton's interpreter, or
    compiled on a GPU machine): each target becomes its source's bytes, every other block stays."""
    from engine.kernels import triton_available
    from engine.kernels.block_copy import triton_copy_blocks

    if not triton_available():
        pytest.skip("triton is not installed")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # 3 layers x 2 x 16 slots x 4 heads x 72 dims: 27,648 elements a block, several chunks of words.
    storage = PagedKVStorage(7, 3, 16, 4, 72, dtype, device)
    storage.cache.copy_(torch.randn(storage.cache.shape, device=device).clamp(-400, 400).to(dtype))
    before = storage.cache.view(torch.uint8).clone()
    triton_copy_blocks(
        storage.cache, torch.tensor([1, 6, 2], device=device), torch.tensor([4, 0, 5], device=device)
    )
    after = storage.cache.view(torch.uint8)
    for source, target in [(1, 4), (6, 0), (2, 5)]:
        assert torch.equal(after[target], before[source])
    untouched = [1, 2, 3, 6, 7]
    assert torch.equal(after[untouched], before[untouched])
