"""Block tables kept on the device: each running request owns one row (its slot) from admission
to finish, so a decoder step gathers rows by slot instead of re-uploading every request's ~120
block ids each step, and a captured CUDA graph can read them from a fixed address.

A request's block ids never change while it runs (the scheduler reserves its worst case at
admission), so its row is written exactly once. A beam hypothesis's self-attention blocks do
change (a fork takes its parent's blocks, a write into a shared block takes a copy): its row is
rewritten when they have (``rewrite_self``), or written by the device when it chooses the beams.
Empty entries and the padding slot name the storage's null block, a block the pool never hands
out: padded rows of a captured batch write their K/V there and read nothing else.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device import upload
from engine.kv.block_pool import RequestBlocks


class DeviceBlockTables:
    def __init__(
        self, max_requests: int, self_blocks: int, cross_blocks: int, null_block: int, device: torch.device
    ):
        self.null_block = null_block
        self.pad_slot = max_requests  # the extra last row: all null blocks
        self.self_tables = torch.full(
            (max_requests + 1, self_blocks), null_block, dtype=torch.int32, device=device
        )
        self.cross_tables = torch.full(
            (max_requests + 1, cross_blocks), null_block, dtype=torch.int32, device=device
        )
        # Each slot's cross-attention length (RequestBlocks.cross_len), gathered by slot as the
        # tables are, so a captured step reads windows of any length; the padding slot reads one key.
        self.cross_lens = torch.ones(max_requests + 1, dtype=torch.int32, device=device)
        self._slot_by_request: dict[str, int] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))

    def slot_of(self, request_id: str, blocks: RequestBlocks) -> int:
        """The request's row, assigned (and written with its ``blocks``) on first use."""
        slot = self._slot_by_request.get(request_id)
        if slot is None:
            if not self._free_slots:
                raise RuntimeError("more running requests than block-table rows (max_num_seqs)")
            slot = self._free_slots.pop()
            self._write_row(self.self_tables, slot, blocks.self_block_ids)
            self._write_row(self.cross_tables, slot, blocks.cross_block_ids)
            self.cross_lens[slot] = max(1, blocks.cross_len)
            self._slot_by_request[request_id] = slot
        return slot

    def rewrite_self(self, rows: dict[int, list[int]]) -> None:
        """Running sequences' self-attention blocks changed (beam hypotheses): rewrite their rows,
        slot -> block ids, in one upload (a step rewrites every hypothesis's row)."""
        if not rows:
            return
        width = self.self_tables.shape[1]
        # One flat list, one array: filling a numpy row from a list costs more than the list's work.
        flat: list[int] = []
        for block_ids in rows.values():
            if len(block_ids) > width:
                raise ValueError(f"{len(block_ids)} blocks do not fit a table row of {width}")
            flat += block_ids
            flat += [self.null_block] * (width - len(block_ids))
        padded = np.array(flat, dtype=np.int32).reshape(len(rows), width)
        device = self.self_tables.device
        self.self_tables.index_copy_(
            0, upload(list(rows), torch.long, device), upload(padded, torch.int32, device)
        )

    def release(self, request_id: str) -> None:
        slot = self._slot_by_request.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _write_row(self, tables: torch.Tensor, slot: int, block_ids: list[int]) -> None:
        if len(block_ids) > tables.shape[1]:
            raise ValueError(f"{len(block_ids)} blocks do not fit a table row of {tables.shape[1]}")
        row = block_ids + [self.null_block] * (tables.shape[1] - len(block_ids))
        tables[slot].copy_(upload(row, torch.int32, tables.device))
