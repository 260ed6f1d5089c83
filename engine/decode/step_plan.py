"""A step's rows gone over once before it launches (engine/decode/pipeline.py): what the runner
needs of them, which rows sample and how, which searches choose on the device, and each request
moved on to after the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.decode.beam_on_device import SearchRows
from engine.decode.request import FROM_LAST_STEP, Request
from engine.decode.runner import StepInput
from engine.decode.sampling import RowsToSample
from engine.decode.search import Search
from engine.decode.steady_tail import SteadyRows, SteadyTail, cross_readers_of

if TYPE_CHECKING:
    from engine.decode.pipeline import StepPipeline


class StepPlan:
    """One pass over a step's rows: what the runner needs of them (StepInput's columns), which rows
    sample and how, which searches choose on the device, and, when launching, each request moved
    on to after the step (its position, what it feeds next, its unread tokens). The rows of beam
    searches whose last choice the device made come last, as one steady tail
    (engine/decode/steady_tail.py) whose columns are made when its searches change."""

    def __init__(
        self,
        pipeline: StepPipeline,
        batch: list[Request],
        searches: dict[int, Search],
        step_id: int | None,
        tail: SteadyTail | None = None,
    ):
        """``searches``: the row where each search's hypotheses start, of those before ``tail``,
        whose rows end ``batch``. ``step_id`` None: describe the rows only, changing nothing (what
        the benchmarks replay)."""
        self.pipeline = pipeline
        self.tables = pipeline.runner.tables
        self.step_id = step_id
        self.limit = pipeline.runner.max_cross_readers
        self.rewrites: dict[int, list[int]] = {}
        self.slots: list[int] = []
        self.tokens: list[list[int]] = []
        self.sources: list[int] = []
        self.starts: list[int] = []
        self.sot_offsets: list[int] = []
        self.epochs: list[int] = []  # each row's request's epoch
        self.readers: list[int] | None = [] if self.limit > 1 and (searches or tail) else None
        self.computed_after: list[int] = []
        self.sot_rows: list[int] = []
        self.detect_rows: list[int] = []
        self.host_rows: list[int] = []
        self.to_sample = RowsToSample()
        self.choosing: list[SearchRows] = []  # searches before the tail that choose on the device
        self.steady_rows: SteadyRows | None = None
        row, count = 0, len(batch) - (len(tail.hypotheses) if tail is not None else 0)
        while row < count:
            search = searches.get(row)
            if search is None:
                self._add_row(batch[row], row)
                if self.readers is not None:
                    self.readers.append(1)
                row += 1
            else:
                row = self._add_search_row_by_row(batch, row, search)
        if tail is not None:
            self._add_steady_tail(tail, row)

    def step_input(self) -> StepInput:
        self.tables.rewrite_self(self.rewrites)
        return StepInput(self.slots, self.tokens, self.sources, self.starts, self.sot_offsets, self.readers)

    def _add_row(self, request: Request, row: int) -> None:
        start, fed = request.num_computed_tokens, request.pending_tokens
        slot = self.tables.slot_of(request.request_id, request.blocks)
        if request.tables_changed:  # a hypothesis forked, or copied a block it writes
            self.rewrites[slot] = request.blocks.self_block_ids
            request.tables_changed = False
        self.slots.append(slot)
        self.tokens.append(fed)
        self.sources.append(request.fed_from_row)
        self.starts.append(start)
        self.epochs.append(request.epoch)
        sot = request.sot_index - start
        feeds_sot = 0 <= sot < len(fed)
        self.sot_offsets.append(sot if feeds_sot else -1)
        computed = start + len(fed)
        self.computed_after.append(computed)
        if self.step_id is None:
            return
        request.num_computed_tokens = computed
        request.launched_in = self.step_id
        if feeds_sot:
            self.sot_rows.append(row)
        if feeds_sot and request.detect_language:
            # The rest of the prompt starts with the language detected here, on the device.
            self.detect_rows.append(row)
            request.detect_language = False
            request.pending_tokens = self.pipeline.next_prompt_tokens_of(request)
            request.pending_tokens[0], request.pending_source_row = FROM_LAST_STEP, row
            self.host_rows.append(row)
            return
        if computed < len(request.prompt_tokens):
            # The rest of the prompt (language, task, timestamp tokens) runs before any sampling.
            request.pending_tokens = self.pipeline.next_prompt_tokens_of(request)
            self.host_rows.append(row)
            return
        to_sample = self.to_sample
        first = not request.output_tokens and not request.unread_tokens
        timestamps = request.options.timestamps
        to_sample.rows.append(row)
        to_sample.requests.append(request)
        to_sample.slots.append(slot)
        to_sample.first.append(first)
        to_sample.timestamps.append(timestamps)
        search = request.hypothesis_of
        to_sample.temperatures.append(request.temperature if search is None else 0.0)
        request.pending_source_row = row
        request.unread_tokens += 1
        self.host_rows.append(row)
        if search is None:
            request.pending_tokens = [FROM_LAST_STEP]
            return
        # Its next token is its search's choice (``_add_search_row_by_row`` says where it is made).
        index = len(to_sample.rows) - 1
        to_sample.hypotheses.append(index)
        if timestamps and not first:
            # It takes over a forked parent's text: its slot's timestamp history follows that text.
            to_sample.restore_history.append(index)

    def _add_search_row_by_row(self, batch: list[Request], row: int, search: Search) -> int:
        """A search whose last choice the host made (or that has made none): its hypotheses may
        differ in where they are (a prompt's rows, forks). Returns the row after its last."""
        end = row + len(search.hypotheses)
        to_sample = self.to_sample
        sampled_before, host_before = len(to_sample.rows), len(self.host_rows)
        may_choose_on_device = (
            self.step_id is not None and self.pipeline.beam_chooser is not None and search.chooses_on_device()
        )
        for index in range(row, end):
            self._add_row(batch[index], index)
        if self.readers is not None:
            self.readers += cross_readers_of(end - row, self.limit)
        if self.step_id is None:
            return end
        sampled = range(sampled_before, len(to_sample.rows))
        if may_choose_on_device and len(sampled) == end - row:
            self.choosing.append(
                SearchRows(search, range(row, end), sampled, self.slots[row:end], self.computed_after[row])
            )
            del self.host_rows[host_before:]
            for hypothesis in batch[row:end]:
                hypothesis.pending_tokens = [FROM_LAST_STEP]
        else:
            to_sample.offering += sampled
            for index in sampled:
                to_sample.requests[index].pending_tokens = []  # chosen on the host once read
        return end

    def _add_steady_tail(self, tail: SteadyTail, row: int) -> None:
        """The steady searches' rows, from ``row`` on: every hypothesis feeds one token (the
        device's, or the host's once that step was read) at its search's position, from its row of
        the last step, and samples; its block-table row is the device's."""
        hypotheses, leaders = tail.hypotheses, tail.leaders
        count = len(hypotheses)
        positions = np.fromiter((leader.num_computed_tokens for leader in leaders), np.int64, len(leaders))
        # A search's hypotheses went in adjacent rows of the last step, in its order.
        sources = np.repeat(
            np.fromiter((leader.fed_from_row for leader in leaders), np.int64, len(leaders)), tail.beam_sizes
        )
        starts = np.repeat(positions, tail.beam_sizes)
        self.slots += tail.slots
        if sources.min() >= 0:  # the usual step: every token still on the device
            self.tokens += tail.fed
            self.sources += (sources + tail.within).tolist()
        else:  # the host read the step before this one launched: some tokens are the host's
            source_rows = np.where(sources >= 0, sources + tail.within, -1).tolist()
            self.sources += source_rows
            self.tokens += [
                fed if source >= 0 else hypothesis.pending_tokens
                for fed, source, hypothesis in zip(tail.fed, source_rows, hypotheses)
            ]
        self.starts += starts.tolist()
        self.sot_offsets += tail.no_sot
        self.epochs += tail.epochs
        if self.readers is not None:
            self.readers += tail.cross_readers
        self.computed_after += (starts + 1).tolist()
        to_sample = self.to_sample
        index = len(to_sample.rows)
        to_sample.rows += range(row, row + count)
        to_sample.requests += hypotheses
        to_sample.slots += tail.slots
        to_sample.first += tail.not_first
        to_sample.timestamps += tail.timestamps
        to_sample.temperatures += tail.temperatures
        to_sample.hypotheses += range(index, index + count)
        after = positions + 1
        self.steady_rows = SteadyRows(tail, row, index, after)
        # A steady search's first hypothesis stands for all of them (engine/decode/search.py says why).
        step_id = self.step_id
        for leader, fed_from, computed_after in zip(
            leaders, (tail.first_hypotheses + row).tolist(), after.tolist()
        ):
            leader.num_computed_tokens = computed_after
            leader.launched_in = step_id
            leader.pending_tokens = [FROM_LAST_STEP]
            leader.pending_source_row = fed_from
            leader.unread_tokens += 1
