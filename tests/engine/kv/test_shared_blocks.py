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
    assert copies == [BlockCopy(source=11, target=12, positions=2)]  # positions 4 and 5 hold K/V
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


def test_a_shared_block_the_write_fills_from_its_first_position_is_replaced_not_copied():
    blocks = SharedBlocks(list(range(10, 20)), BLOCK)
    parent: list[int] = []
    blocks.prepare_write(parent, 0, 8)  # blocks 10 and 11, both full
    child = blocks.fork(parent)
    assert blocks.prepare_write(child, 4, 6) == []  # it rewrites block index 1 from position 4 on
    assert child == [10, 12] and blocks.ref_count(11) == 1 and blocks.ref_count(12) == 1


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


def test_the_storage_copies_the_written_positions_of_every_layer_and_leaves_the_rest():
    storage = PagedKVStorage(6, 2, BLOCK, 2, 3, torch.float32, torch.device("cpu"))
    storage.cache.copy_(torch.randn_like(storage.cache))
    before = storage.cache.clone()
    storage.copy_blocks([BlockCopy(1, 4, positions=BLOCK), BlockCopy(2, 5, positions=3)])
    assert torch.equal(storage.cache[4], before[1])
    # Block 5: positions 0..2 of each layer's keys and values are block 2's, position 3 its own.
    assert torch.equal(storage.cache[5, :, :, :3], before[2, :, :, :3])
    assert torch.equal(storage.cache[5, :, :, 3:], before[5, :, :, 3:])
    untouched = [0, 1, 2, 3, 6]
    assert torch.equal(storage.cache[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads", [4, 3])
def test_the_triton_block_copy_moves_the_written_positions_in_every_cache_dtype(dtype, heads):
    """engine/kernels/block_copy.py's kernel (the GPU's path; here under Triton's interpreter, or
    compiled on a GPU machine): each target's first positions become its source's bytes in every
    layer's keys and values, its other positions and every other block stay. With 3 heads of 10
    dims, an fp8 position is 30 bytes: the kernel copies it as 16-bit words."""
    from engine.kernels import triton_available
    from engine.kernels.block_copy import triton_copy_blocks

    if not triton_available():
        pytest.skip("triton is not installed")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # 3 layers x 2 x 16 slots x heads x 72 or 10 dims: several chunks of words at 4 heads.
    storage = PagedKVStorage(7, 3, 16, heads, 72 if heads == 4 else 10, dtype, device)
    storage.cache.copy_(torch.randn(storage.cache.shape, device=device).clamp(-400, 400).to(dtype))
    before = storage.cache.view(torch.uint8).clone()
    copies = [(1, 4, 16), (6, 0, 5), (2, 5, 1)]
    triton_copy_blocks(
        storage.cache,
        *(torch.tensor(column, device=device) for column in zip(*copies)),
        most=16,
    )
    after = storage.cache.view(torch.uint8)
    for source, target, positions in copies:
        assert torch.equal(after[target, :, :, :positions], before[source, :, :, :positions])
        assert torch.equal(after[target, :, :, positions:], before[target, :, :, positions:])
    untouched = [1, 2, 3, 6, 7]
    assert torch.equal(after[untouched], before[untouched])
