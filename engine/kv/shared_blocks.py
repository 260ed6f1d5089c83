"""Self-attention blocks shared by the hypotheses of one window (beam search), by reference count.

A window decoded with k beams reserves its worst case at admission, as every request does (no
preemption): its cross-attention blocks once, and k hypotheses' worth of self-attention blocks.
The hypotheses then share what they have in common. A fork (a beam continued by several of next
step's beams) shares every block of its parent; a block is copied only when a hypothesis is about
to write into a block that another hypothesis also holds (copy on write), so a fork inside a
block copies that one block and the prompt's blocks are never copied at all. A block whose last
holder lets go goes back to this window's spares, not to the pool: the reservation stays whole
until the window finishes.

Block ids only, never tensors: the copies it asks for are done by the storage, in one batched
operation per step (engine/kv/storage.py ``copy_blocks``). Once a beam search chooses on the
device (engine/decode/step/beam_choice.py), the device decides which hypothesis copies what, from
its block tables, to the search's end: the counts here are then the host's last, and unused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``source``'s K/V at its first ``positions`` positions (every layer) into block
    ``target`` before the step runs: the positions written so far. The rest of the target is
    written by the step or not read (attention reads a sequence's keys up to its length)."""

    source: int
    target: int
    positions: int


class SharedBlocks:
    def __init__(self, reserved_block_ids: list[int], block_size: int, in_use: list[int] = ()):
        """``in_use``: blocks of the reservation already written (a prompt), held by one table."""
        self.block_size = block_size
        self.reserved_block_ids = list(reserved_block_ids)
        self._refs = {block_id: 1 for block_id in in_use}
        self._spare = [
            block_id for block_id in reversed(self.reserved_block_ids) if block_id not in self._refs
        ]

    @property
    def num_spare(self) -> int:
        return len(self._spare)

    def ref_count(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def fork(self, table: list[int]) -> list[int]:
        """A new holder of every block of ``table``: the same ids, each one reference more."""
        self.hold(table, 1)
        return list(table)

    def drop(self, table: list[int]) -> None:
        """A holder lets go of ``table``'s blocks; a block nobody holds becomes a spare again."""
        self.hold(table, -1)

    def hold(self, table: list[int], more: int) -> None:
        """``more`` holders of every block of ``table`` (fewer, when negative); a block nobody
        holds becomes a spare again."""
        if more == 0:
            return
        refs = self._refs
        for block_id in table:
            refs[block_id] += more
            if refs[block_id] == 0:
                del refs[block_id]
                self._spare.append(block_id)

    def prepare_write(self, table: list[int], start: int, end: int) -> list[BlockCopy]:
        """Make positions [start, end) of ``table``'s sequence its holder's own to write: a spare
        block where the table ends, a private copy of a block another holder shares (of the
        positions before ``start`` in it; a block the write fills from its first position needs no
        copy, only a block of its own). Changes ``table`` in place; returns the copies to make
        before the write."""
        copies: list[BlockCopy] = []
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if index == len(table):
                table.append(self._take())
            elif index > len(table):
                raise ValueError(f"position {index * self.block_size} is past the table's end")
            elif self._refs[table[index]] > 1:
                target = self._take()
                written = min(self.block_size, start - index * self.block_size)
                if written > 0:
                    copies.append(BlockCopy(source=table[index], target=target, positions=written))
                self._refs[table[index]] -= 1
                table[index] = target
        return copies

    def _take(self) -> int:
        if not self._spare:
            # The window reserved its worst case at admission: running out is a bug, not load.
            raise RuntimeError("a window's hypotheses used more self-attention blocks than it reserved")
        block_id = self._spare.pop()
        self._refs[block_id] = 1
        return block_id
