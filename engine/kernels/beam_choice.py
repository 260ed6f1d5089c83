"""A step's beam choices as one Triton kernel: one program per beam search ranks its hypotheses'
candidates, picks the children and moves every child's state to its slot (engine/decode/step/
beam_choice.py says what a choice does; its PyTorch version there is the reference).

As PyTorch operations a choice takes dozens of small kernels, whose launches cost the host more time
than the choice saves on a small model's step. A search ranks at most a few dozen candidates
(k x (k + 1)), so the program ranks them by counting, for each candidate, the candidates before
it (a larger sum, or the same sum offered earlier: a stable sort, best first) in one square of
comparisons, with no sort. It reads everything a child takes from its parent (block-table row,
timestamp history, sum) before it writes any child's: parents and children share the search's
slots. The spare blocks children write into are the search's reserved blocks no hypothesis's
block-table row holds before the choice, in the reservation's order (the same square of
comparisons): the device keeps the tables while it chooses, and the host hands out no blocks.

JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

# Columns of the per-search rows the kernel reads, in order.
SEARCH_FIELDS = (
    "beam_size",
    "first_hypothesis",
    "first_candidate",
    "first_row",
    "block_index",
    "offset",
    "eot",
    "first_reserved",
    "num_reserved",
)

if triton_available():

    def _choose_beams_kernel(
        CANDIDATES,
        stride_plane,
        stride_candidate,
        SEARCHES,
        stride_search,
        HYPOTHESES,
        RESERVED,
        SUMS,
        NEXT_TOKENS,
        TABLES,
        stride_table,
        table_width,
        HISTORY,
        stride_history,
        COPIES,
        stride_copies,
        RANKED,
        stride_ranked,
        timestamp_begin,
        MOST: tl.constexpr,
        BEAMS: tl.constexpr,
        WIDTH: tl.constexpr,
        MOST_RESERVED: tl.constexpr,
    ):
        search = tl.program_id(0)
        fields = SEARCHES + search * stride_search  # in SEARCH_FIELDS's order
        k = tl.load(fields)
        first_hypothesis = tl.load(fields + 1)
        first_candidate = tl.load(fields + 2)
        first_row = tl.load(fields + 3)
        block_index = tl.load(fields + 4)
        offset = tl.load(fields + 5)
        eot = tl.load(fields + 6)
        first_reserved = tl.load(fields + 7)
        num_reserved = tl.load(fields + 8)
        offered = k * (k + 1)

        # Candidate i: hypothesis i // (k + 1)'s (i % (k + 1))-th likeliest token.
        i = tl.arange(0, MOST)
        valid = i < offered
        hypothesis = i // (k + 1)
        slot = tl.load(HYPOTHESES + first_hypothesis + hypothesis, mask=valid, other=0)
        at = (first_candidate + hypothesis) * stride_candidate + i % (k + 1)
        token = tl.load(CANDIDATES + at, mask=valid, other=0.0).to(tl.int64)
        logprob = tl.load(CANDIDATES + stride_plane + at, mask=valid, other=0.0)
        total = tl.load(SUMS + slot, mask=valid, other=0.0) + logprob

        # before[i, j]: candidate j ranks before candidate i.
        before = (total[None, :] > total[:, None]) | (
            (total[None, :] == total[:, None]) & (i[None, :] < i[:, None])
        )
        before = before & valid[None, :]
        rank = tl.sum(before.to(tl.int32), axis=1)
        # The ranking, for the host to follow: each rank's candidate, sum, token and log-probability.
        ranked = RANKED + search * MOST + rank
        tl.store(ranked, i.to(tl.float32), mask=valid)
        tl.store(ranked + stride_ranked, total, mask=valid)
        tl.store(ranked + 2 * stride_ranked, token.to(tl.float32), mask=valid)
        tl.store(ranked + 3 * stride_ranked, logprob, mask=valid)
        goes_on = valid & (token != eot)
        goes_on_before = tl.sum((before & goes_on[None, :]).to(tl.int32), axis=1)
        chosen = goes_on & (goes_on_before < k)

        # Child c: the chosen candidate with c chosen before it.
        child = tl.arange(0, BEAMS)
        is_child = child < k
        picks = chosen[None, :] & (goes_on_before[None, :] == child[:, None])
        parent = tl.sum(tl.where(picks, hypothesis[None, :], 0), axis=1)
        child_token = tl.sum(tl.where(picks, token[None, :], 0), axis=1)
        child_total = tl.sum(tl.where(picks, total[None, :], 0.0), axis=1)
        child_slot = tl.load(HYPOTHESES + first_hypothesis + child, mask=is_child, other=0)
        parent_slot = tl.load(HYPOTHESES + first_hypothesis + parent, mask=is_child, other=0)
        later_sibling = (parent[None, :] == parent[:, None]) & (child[None, :] > child[:, None])
        is_last_child = tl.sum((later_sibling & is_child[None, :]).to(tl.int32), axis=1) == 0
        takes_spare = is_child & ((offset == 0) | (is_last_child == 0))

        # The free blocks: the reserved ones in no hypothesis's row, among the columns written so
        # far (and the one written next, unless the write starts it). The j-th child that takes a
        # spare takes the j-th free block.
        r = tl.arange(0, MOST_RESERVED)
        in_reservation = r < num_reserved
        reserved = tl.load(RESERVED + first_reserved + r, mask=in_reservation, other=-1)
        entry = tl.arange(0, BEAMS * WIDTH)  # hypothesis entry // WIDTH's column entry % WIDTH
        entry_column = entry % WIDTH
        live = (entry // WIDTH < k) & (entry_column < block_index + (offset > 0).to(tl.int64))
        live = live & (entry_column < table_width)
        entry_slot = tl.load(HYPOTHESES + first_hypothesis + entry // WIDTH, mask=live, other=0)
        held = tl.load(TABLES + entry_slot * stride_table + entry_column, mask=live, other=-2).to(tl.int64)
        holders = tl.sum(((reserved[:, None] == held[None, :]) & live[None, :]).to(tl.int32), axis=1)
        free = in_reservation & (holders == 0)
        free_before = tl.sum((free[None, :] & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
        takers_before = tl.sum(
            (takes_spare[None, :] & (child[None, :] < child[:, None])).to(tl.int32), axis=1
        )
        picks_block = free[None, :] & (free_before[None, :] == takers_before[:, None])
        spare = tl.sum(tl.where(picks_block, reserved[None, :], 0), axis=1)

        column = tl.arange(0, WIDTH)
        in_row = is_child[:, None] & (column[None, :] < table_width)
        row = tl.load(TABLES + parent_slot[:, None] * stride_table + column[None, :], mask=in_row, other=0)
        current = tl.load(TABLES + parent_slot * stride_table + block_index, mask=is_child, other=0)
        last_was_stamp = tl.load(HISTORY + parent_slot, mask=is_child, other=0)
        last_stamp = tl.load(HISTORY + 2 * stride_history + parent_slot, mask=is_child, other=-1)
        tl.debug_barrier()  # every parent's state read before any child's is written

        own = (column[None, :] == block_index) & takes_spare[:, None]
        tl.store(
            TABLES + child_slot[:, None] * stride_table + column[None, :],
            tl.where(own, spare[:, None].to(row.dtype), row),
            mask=in_row,
        )
        tl.store(NEXT_TOKENS + first_row + child, child_token, mask=is_child)
        tl.store(SUMS + child_slot, child_total, mask=is_child)
        is_stamp = child_token >= timestamp_begin
        tl.store(HISTORY + child_slot, is_stamp.to(tl.int64), mask=is_child)
        tl.store(HISTORY + stride_history + child_slot, last_was_stamp, mask=is_child)
        tl.store(
            HISTORY + 2 * stride_history + child_slot,
            tl.where(is_stamp, child_token, last_stamp),
            mask=is_child,
        )
        tl.store(COPIES + first_hypothesis + child, current.to(tl.int64), mask=is_child)
        tl.store(COPIES + stride_copies + first_hypothesis + child, spare, mask=is_child)
        tl.store(
            COPIES + 2 * stride_copies + first_hypothesis + child,
            tl.where(takes_spare, offset, 0),
            mask=is_child,
        )


_JITTED: dict[str, object] = {}


def triton_choose_beams(
    candidates: torch.Tensor,
    searches: torch.Tensor,
    slots: torch.Tensor,
    reserved: torch.Tensor,
    sums: torch.Tensor,
    next_tokens: torch.Tensor,
    tables: torch.Tensor,
    history: torch.Tensor,
    timestamp_begin: int,
    most_beams: int,
    most_reserved: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The choices of ``searches`` [S, 9] (columns SEARCH_FIELDS) from ``candidates`` [2, H, width]
    float32 (tokens, log-probabilities); ``slots`` [N] int64: each hypothesis's slot, a search's
    ``beam_size`` of them from its ``first_hypothesis``; ``reserved``: the searches' reserved
    self-attention blocks, a search's ``num_reserved`` (at most ``most_reserved``) from its
    ``first_reserved``. Writes the children's next tokens, sums, block-table rows and timestamp
    histories. Returns each search's ranking [4, S, most_beams * (most_beams + 1) rounded up to a
    power of two] float32: by rank, best first, the candidate's flat index, sum, token and
    log-probability (past a search's k * (k + 1) unset), and the block copies to make [3, N]:
    source, target, positions (0: none)."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_choose_beams_kernel)
    most = triton.next_power_of_2(most_beams * (most_beams + 1))
    ranked = torch.empty((4, len(searches), most), dtype=torch.float32, device=candidates.device)
    copies = torch.empty((3, len(slots)), dtype=torch.long, device=candidates.device)
    _JITTED["kernel"][(len(searches),)](
        candidates,
        candidates.stride(0),
        candidates.stride(1),
        searches,
        searches.stride(0),
        slots,
        reserved,
        sums,
        next_tokens,
        tables,
        tables.stride(0),
        tables.shape[1],
        history,
        history.stride(0),
        copies,
        copies.stride(0),
        ranked,
        ranked.stride(0),
        timestamp_begin,
        MOST=most,
        BEAMS=triton.next_power_of_2(most_beams),
        WIDTH=triton.next_power_of_2(tables.shape[1]),
        MOST_RESERVED=triton.next_power_of_2(most_reserved),
        num_warps=4,
    )
    return ranked, copies
