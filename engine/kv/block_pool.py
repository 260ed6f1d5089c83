"""The KV block pool: which fixed-size blocks are free, and which request holds which.

It knows block ids, never tensors (the tensors live in kv_storage.PagedKVStorage). One pool serves
both self-attention blocks (grow with generated tokens) and cross-attention blocks (1500 encoder
frames, written once), so memory shifts to whichever a workload needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.arith import ceil_div
from engine.errors import CacheFullError


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[5, 6, 7, 2, 3] -> [(5, 3), (2, 2)]: maximal runs of consecutive ids, in order (a run of a
    block-major cache is one contiguous region: one strided view, one transfer descriptor)."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return ceil_div(num_tokens, block_size)


@dataclass
class RequestBlocks:
    """A request's block tables: self-attention blocks in token order, then its cross blocks; and
    the self-attention blocks it holds for its beam hypotheses (engine/kv/shared_blocks.py)."""

    self_block_ids: list[int] = field(default_factory=list)
    cross_block_ids: list[int] = field(default_factory=list)
    spare_block_ids: list[int] = field(default_factory=list)
    # Encoder frames the cross blocks hold: a full window's, or fewer for a pass encoded over the
    # audio it has (its last block then partly filled). Cross-attention reads this many keys. Written
    # with the blocks, from the request's cross-K/V source (whose number it keeps once the source is
    # dropped); 0 while there are no blocks.
    cross_len: int = 0

    def all_ids(self) -> list[int]:
        return self.self_block_ids + self.cross_block_ids + self.spare_block_ids


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise CacheFullError("the KV cache has no blocks: raise kv_cache_memory_mb")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._allocated)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CacheFullError(f"asked for {count} KV blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(count)]
        self._allocated.update(block_ids)
        return block_ids

    def allocate_consecutive(self, count: int) -> list[int]:
        """``count`` blocks with consecutive ids (the lowest such free run), or where no run of
        ``count`` is free, any ``count`` blocks as ``allocate`` gives them. An attention backend that
        reads a run of blocks as one strided view asks for this (AttentionBackend.
        prefers_consecutive_blocks). Sorts the free ids: meant for pools of a CPU's size (hundreds
        to thousands of blocks), not once per step."""
        if count > len(self._free):
            raise CacheFullError(f"asked for {count} KV blocks, {len(self._free)} free")
        free = sorted(self._free)
        for index in range(len(free) - count + 1):
            if free[index + count - 1] - free[index] == count - 1:  # distinct and sorted: a run
                block_ids = free[index : index + count]
                break
        else:
            return self.allocate(count)
        taken = set(block_ids)
        self._free = deque(block_id for block_id in self._free if block_id not in taken)
        self._allocated.update(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            # A double free would hand one block to two requests; fail loudly instead.
            if block_id not in self._allocated:
                raise RuntimeError(f"KV block {block_id} freed twice or never allocated")
            self._allocated.remove(block_id)
            self._free.append(block_id)
