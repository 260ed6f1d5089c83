"""Beam choices made on the device, so that a beam search's next step can launch before the host
has read the last one (engine/decode/step/pipeline.py's async steps).

For each search (on a GPU in one Triton kernel for the whole step, engine/kernels/beam_choice.py,
replayed with its block copies from a CUDA graph, engine/decode/step/choice_graphs.py; elsewhere in
PyTorch operations, a batch of searches of one beam size at a time): its
hypotheses' candidates are ranked by their float32 sums of log-probabilities (a stable sort, best
first, as ``BeamSearch.update`` ranks them), the first ``beam_size`` that do not end the text are
the children, and then, for every child, on the device:
- its chosen token goes where the next step feeds its row from (``next_tokens``);
- its sum, and its timestamp history (its parent's followed by the token), go to its slot;
- its block-table row becomes its parent's, except in the block it writes next: there the last
  child of each parent keeps the parent's block, and the others write into a spare block, after a
  copy of the positions the parent wrote there (where that block starts, every child takes a
  spare, and nothing is copied). The spares are the search's reserved blocks that no hypothesis's
  row holds before the choice, in the reservation's order: the device reads that from the rows.
Once the device has chosen for a search, it chooses for it to the end, and the block tables are
the device's alone (the host never chooses for it again, so it never needs them back). The host
follows each choice one step late from the ranking (each rank's candidate, sum, token and
log-probability), read back with the step (``Search.follow_device_choice``): its texts and sums
are the device's once read. Each hypothesis writes only into a block of its own (copy on write at
every choice), which is what lets the device decide without reference counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.decode.batch import SearchRows, SteadyRows
from engine.decode.step.choice_graphs import (
    ChoiceGraphs,
    ChoiceKernelArgs,
    ChoiceShape,
    launch_choice,
    steady_choice_fields,
    steady_logit_rows,
)
from engine.decode.step.logit_rules import LogitRules
from engine.decode.step.output import DeviceRankings, FirstRanks, Ranking
from engine.decode.step.runner import ModelRunner
from engine.decode.step.sampling import top_candidates
from engine.device import upload
from engine.kernels import triton_available


@dataclass(frozen=True)
class DeviceChoices:
    """A launched step's choices: each search's ranking of its candidates, on the device (the step
    downloads it with its tokens)."""

    # [4, searches, >= k * (k + 1)] float32: row i ranks ``searches[i]``'s candidates, best first:
    # each rank's flat candidate index, sum of log-probabilities, token and log-probability.
    rankings: torch.Tensor
    # Gathered while the choice launches (gathering them again from the searches costs the read):
    beam_sizes: np.ndarray  # [searches] int64: each search's hypotheses, k
    text_ends: np.ndarray  # [searches] int64: each search's token that ends a text (-1: none)

    def read(self, rankings: np.ndarray) -> DeviceRankings:
        """The rankings, from ``rankings`` downloaded once the step has run: every search's first
        ``beam_size`` ranks as arrays, and every rank of a search whose text may end among them
        (only those are converted to Python numbers: the usual step needs none)."""
        beams, ends = self.beam_sizes, self.text_ends
        most = int(beams.max())
        # Integer division of the flat candidate indexes, and only of the first ranks: dividing
        # every rank's float index costs more than the rest of the read.
        token_head = rankings[2, :, :most].astype(np.int64)
        first_ranks = FirstRanks(
            rankings[0, :, :most].astype(np.int64) // (beams + 1)[:, None],
            token_head,
            rankings[3, :, :most].copy(),  # copies: the pinned buffer goes back for reuse
            rankings[1, :, :most].copy(),
        )
        may_end = ((token_head == ends[:, None]) & (np.arange(most) < beams[:, None])).any(axis=1)
        every_rank = {}
        for row in np.flatnonzero(may_end).tolist():
            k = int(beams[row])
            offered = k * (k + 1)
            every_rank[row] = Ranking(
                (rankings[0, row, :offered].astype(np.int64) // (k + 1)).tolist(),
                rankings[2, row, :offered].astype(np.int64).tolist(),
                rankings[3, row, :offered].tolist(),
                rankings[1, row, :offered].tolist(),
            )
        # Every candidate is ranked, so a hypothesis whose logits overflowed shows as NaN here.
        candidates = beams * (beams + 1)
        ranked = np.arange(int(candidates.max())) < candidates[:, None]
        overflowed = (np.isnan(rankings[3, :, : ranked.shape[1]]) & ranked).any(axis=1)
        return DeviceRankings(first_ranks, every_rank, overflowed)


class DeviceBeamChooser:
    def __init__(
        self, runner: ModelRunner, rules: LogitRules, num_slots: int, use_triton: bool | None = None
    ):
        self.runner = runner
        self.rules = rules
        self.block_size = runner.storage.block_size
        # Each slot's hypothesis's sum of log-probabilities, float32 as the host keeps them.
        self.sums = torch.zeros(num_slots, dtype=torch.float32, device=runner.device)
        # On a GPU one Triton kernel (engine/kernels/beam_choice.py); elsewhere PyTorch operations
        # (True runs the kernel under Triton's interpreter).
        self.use_triton = (
            use_triton if use_triton is not None else runner.device.type == "cuda" and triton_available()
        )
        self.kernel_args = ChoiceKernelArgs(
            self.sums,
            runner.next_tokens,
            runner.tables.self_tables,
            rules.history,
            rules.special.timestamp_begin,
            runner.storage,
        )
        # On a GPU both kernels replay from CUDA graphs (engine/decode/step/choice_graphs.py).
        self.graphs = (
            ChoiceGraphs(self.kernel_args, num_slots)
            if self.use_triton and runner.device.type == "cuda"
            else None
        )

    def choose(
        self, choosing: list[SearchRows], steady: SteadyRows | None, logits: torch.Tensor
    ) -> DeviceChoices:
        """Make the choices of ``choosing`` (searches whose last choice the host made) and of the
        steady tail's searches (whose last choice the device made) from the step's sampled rows'
        filtered logits [rows, vocab] (each hypothesis's ``k + 1`` likeliest tokens its
        candidates, scored by their log-softmax), with no read to the host."""
        device = self.sums.device
        if choosing:  # the host made these searches' last choice: their sums start from the host's
            slots = [slot for entry in choosing for slot in entry.slots]
            sums = [total for entry in choosing for total in entry.sums]
            self.sums[upload(slots, torch.long, device)] = upload(sums, torch.float32, device)
        reservations = [entry.reserved for entry in choosing]
        beam_sizes = np.array([len(entry.rows) for entry in choosing], dtype=np.int64)
        text_ends = np.array([entry.text_end for entry in choosing], dtype=np.int64)
        positions = np.array([entry.position for entry in choosing], dtype=np.int64)
        if steady is not None:
            tail = steady.tail
            beam_sizes = np.concatenate([beam_sizes, tail.beam_sizes])
            text_ends = np.concatenate([text_ends, tail.text_ends])
            positions = np.concatenate([positions, steady.positions])
        most_written = int((positions % self.block_size).max())
        most_beams = int(beam_sizes.max())
        if self.use_triton:
            rankings = self._choose_in_one_kernel(
                choosing, reservations, steady, logits, most_written, most_beams
            )
        else:
            if steady is not None:
                choosing = choosing + self._search_rows_of(steady)
                reservations = reservations + steady.tail.reservations
            rankings = self._choose_with_torch(choosing, reservations, logits, most_written, most_beams)
        return DeviceChoices(rankings, beam_sizes, text_ends)

    @staticmethod
    def _search_rows_of(steady: SteadyRows) -> list[SearchRows]:
        """The steady tail's searches one by one (the PyTorch way chooses for a search at a time)."""
        tail = steady.tail
        entries = []
        for first, k, position, text_end, reserved in zip(
            tail.first_hypotheses.tolist(),
            tail.beam_sizes.tolist(),
            steady.positions.tolist(),
            tail.text_ends.tolist(),
            tail.reservations,
        ):
            row, logit_row = steady.first_row + first, steady.first_logit_row + first
            entries.append(
                SearchRows(
                    range(row, row + k),
                    range(logit_row, logit_row + k),
                    tail.slots[first : first + k],
                    position,
                    [],  # the device holds its sums
                    text_end,
                    reserved,
                )
            )
        return entries

    def _choose_in_one_kernel(
        self,
        choosing: list[SearchRows],
        reservations: list[list[int]],
        steady: SteadyRows | None,
        logits: torch.Tensor,
        most_written: int,
        most_beams: int,
    ) -> torch.Tensor:
        """Every hypothesis's candidates in one Triton kernel, every search's choice in one more,
        and the block copies in a third."""
        fields: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        reserved: list[int] = []
        for entry, reservation in zip(choosing, reservations):
            # In SEARCH_FIELDS's order (a dict per search would cost the host more than the kernel).
            fields += (
                len(entry.rows),
                len(slots),
                len(slots),  # the candidates are the hypotheses', in their order
                entry.rows[0],
                entry.position // self.block_size,
                entry.position % self.block_size,
                entry.text_end,
                len(reserved),
                len(reservation),
            )
            slots += entry.slots
            logit_rows += entry.logit_rows
            reserved += reservation
        # The searches' fields, each hypothesis's slot and row of logits, the searches' reserved
        # blocks: one upload.
        most_reserved = max(map(len, reservations), default=1)
        if steady is None:
            packed: list[int] | np.ndarray = fields + slots + logit_rows + reserved
            counts = (len(choosing), len(slots), len(reserved))
        else:
            tail = steady.tail
            packed = np.concatenate(
                [
                    np.array(fields, dtype=np.int64),
                    steady_choice_fields(steady, self.block_size, len(slots), len(reserved)).ravel(),
                    np.array(slots, dtype=np.int64),
                    tail.choice_slots,
                    np.array(logit_rows, dtype=np.int64),
                    steady_logit_rows(steady),
                    np.array(reserved, dtype=np.int64),
                    tail.reserved,
                ]
            )
            counts = (
                len(choosing) + len(tail.beam_sizes),
                len(slots) + tail.num_rows,
                len(reserved) + len(tail.reserved),
            )
            most_reserved = max(most_reserved, tail.most_reserved)
        shape = ChoiceShape(
            searches=counts[0],
            hypotheses=counts[1],
            reserved=counts[2],
            most_beams=most_beams,
            most_reserved=1 << (most_reserved - 1).bit_length(),
        )
        if self.graphs is not None:
            return self.graphs.choose(logits, packed, shape)
        on_device = upload(packed, torch.long, self.sums.device)
        return launch_choice(self.kernel_args, logits, on_device, shape, most_written)

    def _choose_with_torch(
        self,
        choosing: list[SearchRows],
        reservations: list[list[int]],
        logits: torch.Tensor,
        most_written: int,
        most_beams: int,
    ) -> torch.Tensor:
        """The same choices as PyTorch operations, a batch of searches of one beam size at a time."""
        rankings = torch.zeros(
            (4, len(choosing), most_beams * (most_beams + 1)), dtype=torch.float32, device=self.sums.device
        )
        by_size: dict[int, list[int]] = {}
        for position, entry in enumerate(choosing):
            by_size.setdefault(len(entry.rows), []).append(position)
        for beam_size, positions in by_size.items():
            group = [choosing[position] for position in positions]
            group_reservations = [reservations[position] for position in positions]
            ranking = self._choose_group(beam_size, group, group_reservations, logits, most_written)
            rows = upload(positions, torch.long, self.sums.device)
            rankings[:, rows, : beam_size * (beam_size + 1)] = ranking
        return rankings

    def _choose_group(
        self,
        beam_size: int,
        group: list[SearchRows],
        reservations: list[list[int]],
        logits: torch.Tensor,
        most_written: int,
    ) -> torch.Tensor:
        """The choices of searches of one beam size; returns their rankings [4, searches, k * (k + 1)]."""
        k, width, count = beam_size, beam_size + 1, len(group)
        per_row = [
            [row for entry in group for row in entry.logit_rows],
            [slot for entry in group for slot in entry.slots],
            [row for entry in group for row in entry.rows],
            [entry.position // self.block_size for entry in group for _ in range(k)],
            [entry.position % self.block_size for entry in group for _ in range(k)],
            [entry.text_end for entry in group for _ in range(k)],
        ]
        logit_rows, slots, rows, index, offset, eot = upload(per_row, torch.long, self.sums.device)
        most_reserved = max(map(len, reservations))
        # Each search's reserved blocks, padded with -1 (no block).
        reserved = upload(
            [reservation + [-1] * (most_reserved - len(reservation)) for reservation in reservations],
            torch.long,
            self.sums.device,
        )
        offered = top_candidates(logits, logit_rows, width)
        tokens = offered[0].long().view(count, k * width)
        sums = (self.sums[slots].view(count, k, 1) + offered[1].view(count, k, width)).view(count, k * width)
        order = torch.sort(sums, dim=1, descending=True, stable=True).indices
        goes_on = tokens.gather(1, order) != eot.view(count, k)[:, :1]
        chosen = goes_on & (goes_on.cumsum(dim=1) <= k)  # exactly k: no hypothesis offers eot twice
        ranks = torch.arange(k * width, device=sums.device).expand(count, -1)
        best_first = torch.where(chosen, ranks, k * width).sort(dim=1).values[:, :k]
        flat = order.gather(1, best_first)  # [searches, k]: child j's candidate
        parents = flat // width
        child_tokens = tokens.gather(1, flat).view(-1)
        parent_slots = slots.view(count, k).gather(1, parents).view(-1)
        self.runner.next_tokens[rows] = child_tokens
        self.sums[slots] = sums.gather(1, flat).view(-1)
        self.rules.continue_histories(slots, parent_slots, child_tokens)
        self._follow_parents_blocks(parents, slots, reserved, index, offset, most_written)
        logprobs = offered[1].reshape(count, k * width)
        return torch.stack(
            [order.float(), sums.gather(1, order), tokens.gather(1, order).float(), logprobs.gather(1, order)]
        )

    def _follow_parents_blocks(
        self,
        parents: torch.Tensor,
        slots: torch.Tensor,
        reserved: torch.Tensor,
        index: torch.Tensor,
        offset: torch.Tensor,
        most_written: int,
    ) -> None:
        """Each child's block-table row: its parent's, with a block of its own at ``index`` (a
        spare: a block of its search's ``reserved`` [searches, R] that no hypothesis's row holds);
        the copies of the parents' written positions (``offset``, at most ``most_written``) into
        the spares taken."""
        count, k = parents.shape
        later = torch.ones(k, k, dtype=torch.bool, device=parents.device).triu(diagonal=1)
        is_last_child = ~((parents[:, :, None] == parents[:, None, :]) & later).any(dim=-1).view(-1)
        takes_spare = (offset == 0) | ~is_last_child
        tables = self.runner.tables.self_tables
        hypotheses_rows = tables.index_select(0, slots)  # a copy: read before children are written
        spares = self._free_blocks(hypotheses_rows, reserved, index, offset, takes_spare)
        first_of_search = torch.arange(0, count * k, k, device=parents.device).view(-1, 1)
        rows = hypotheses_rows[(first_of_search + parents).view(-1)]  # each child's parent's row
        column = index.view(-1, 1)
        current = rows.gather(1, column).view(-1)
        rows.scatter_(1, column, torch.where(takes_spare, spares.to(rows.dtype), current).view(-1, 1))
        tables.index_copy_(0, slots, rows)
        positions = torch.where(takes_spare, offset, 0)
        self.runner.storage.copy_blocks_on_device(current.long(), spares, positions, most_written)

    @staticmethod
    def _free_blocks(
        rows: torch.Tensor,
        reserved: torch.Tensor,
        index: torch.Tensor,
        offset: torch.Tensor,
        takes: torch.Tensor,
    ) -> torch.Tensor:
        """The spare each child takes (where ``takes``): the j-th child that takes one in a search
        takes the j-th of its reserved blocks that none of its hypotheses' ``rows`` [searches * k,
        width] holds in the columns written so far (and the one written next, unless the write
        starts it), as the choice's kernel picks them."""
        count = reserved.shape[0]
        k = rows.shape[0] // count
        columns = torch.arange(rows.shape[1], device=rows.device)
        live = columns[None, :] < (index + (offset > 0).long()).view(-1, 1)
        held = torch.where(live, rows.long(), -2).view(count, 1, -1)
        free = (reserved >= 0) & ~(reserved[:, :, None] == held).any(dim=-1)
        takes = takes.view(count, k)
        if not free.is_cuda and bool((free.sum(dim=1) < takes.sum(dim=1)).any()):
            # The reservation covers the worst case (engine/decode/scheduler/policy.py): a bug, not load.
            # Checked where it costs nothing (on a GPU it would wait for the device).
            raise RuntimeError("a window's hypotheses used more self-attention blocks than it reserved")
        # Positions of the free blocks first, in the reservation's order.
        free_first = torch.sort((~free).to(torch.int8), dim=1, stable=True).indices
        takers_before = takes.long().cumsum(dim=1) - takes.long()
        return reserved.gather(1, free_first.gather(1, takers_before)).view(-1)
