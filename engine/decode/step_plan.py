"""A step's rows gone over once before it launches (engine/decode/pipeline.py): what the runner
needs of them, which rows sample and how, which searches choose on the device, and each request
moved on to after the step."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from engine.decode.beam_on_device import SearchRows
from engine.decode.request import FROM_LAST_STEP, Request
from engine.decode.runner import StepInput
from engine.decode.sampling import RowsToSample
from engine.decode.search import Search

if TYPE_CHECKING:
    from engine.decode.pipeline import StepPipeline

# A hypothesis row's fed tokens in a step after a choice made on the device (shared, never changed).
_FED_FROM_LAST_STEP = [FROM_LAST_STEP]


@functools.cache
def _cross_readers_of(hypotheses: int, limit: int) -> tuple[int, ...]:
    """A search's rows' cross-attention readers (StepInput.cross_readers): each run of up to
    ``limit`` rows is read once, counted by its first row."""
    return tuple(min(limit, hypotheses - index) if index % limit == 0 else 0 for index in range(hypotheses))


class SteadyColumns(NamedTuple):
    """A search's rows' columns that stay the same from step to step while its choices are made on
    the device (its hypotheses feed the device's tokens and sample, at one position): made once per
    number of hypotheses and extended with as they are, rather than made again every step."""

    slots: list[int]
    fed: list[list[int]]
    no_sot: list[int]
    readers: tuple[int, ...]
    not_first: list[bool]
    timestamps: list[bool]
    temperatures: list[float]


class StepPlan:
    """One pass over a step's rows: what the runner needs of them (StepInput's columns), which rows
    sample and how, which searches choose on the device, and, when launching, each request moved
    on to after the step (its position, what it feeds next, its unread tokens). A beam search whose
    last choice the device made is gone over a search at a time: its hypotheses all feed the
    device's tokens from adjacent rows at one position, and at many beams the host's work per row
    is what bounds a step."""

    def __init__(
        self, pipeline: StepPipeline, batch: list[Request], searches: dict[int, Search], step_id: int | None
    ):
        """``searches``: the row where each search's hypotheses start. ``step_id`` None: describe
        the rows only, changing nothing (what the benchmarks replay)."""
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
        self.readers: list[int] | None = [] if self.limit > 1 and searches else None
        self.computed_after: list[int] = []
        self.sot_rows: list[int] = []
        self.detect_rows: list[int] = []
        self.host_rows: list[int] = []
        self.to_sample = RowsToSample()
        self.choosing: list[SearchRows] = []
        # Each search's SteadyColumns: this plan's (what the next one reuses, from the pipeline).
        self.steady: dict[Search, SteadyColumns] = {}
        row, count = 0, len(batch)
        while row < count:
            search = searches.get(row)
            if search is None:
                self._add_row(batch[row], row)
                if self.readers is not None:
                    self.readers.append(1)
                row += 1
            elif search.host_chose_last:
                row = self._add_search_row_by_row(batch, row, search)
            else:
                row = self._add_search_after_device_choice(row, search)

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
            self.readers += _cross_readers_of(end - row, self.limit)
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

    def _add_search_after_device_choice(self, row: int, search: Search) -> int:
        """A search whose last choice the device made (so it makes this one too): every hypothesis
        feeds one token (the device's, or the host's once that step was read) at one position,
        from adjacent rows of the last step, and samples; its block-table rows are the device's.
        Returns the row after its last."""
        hypotheses = search.hypotheses
        count = len(hypotheses)
        end = row + count
        columns = self._steady_columns_of(search)
        start = hypotheses[0].num_computed_tokens
        source = hypotheses[0].fed_from_row
        self.slots += columns.slots
        if source >= 0:
            self.tokens += columns.fed
            self.sources += range(source, source + count)
        else:
            self.tokens += [hypothesis.pending_tokens for hypothesis in hypotheses]
            self.sources += [-1] * count
        self.starts += [start] * count
        self.sot_offsets += columns.no_sot
        self.epochs += [hypotheses[0].epoch] * count
        if self.readers is not None:
            self.readers += columns.readers
        computed = start + 1
        self.computed_after += [computed] * count
        to_sample = self.to_sample
        index = len(to_sample.rows)
        rows, sampled = range(row, end), range(index, index + count)
        to_sample.rows += rows
        to_sample.requests += hypotheses
        to_sample.slots += columns.slots
        to_sample.first += columns.not_first
        to_sample.timestamps += columns.timestamps
        to_sample.temperatures += columns.temperatures
        to_sample.hypotheses += sampled
        self.choosing.append(SearchRows(search, rows, sampled, columns.slots, computed))
        step_id = self.step_id
        for fed_from, hypothesis in enumerate(hypotheses, row):
            hypothesis.num_computed_tokens = computed
            hypothesis.launched_in = step_id
            hypothesis.pending_tokens = [FROM_LAST_STEP]
            hypothesis.pending_source_row = fed_from
            hypothesis.unread_tokens += 1
        return end

    def _steady_columns_of(self, search: Search) -> SteadyColumns:
        """The search's SteadyColumns: the last plan's while it has as many hypotheses (each keeps
        its block-table slot, and the columns depend on nothing else)."""
        hypotheses = search.hypotheses
        count = len(hypotheses)
        columns = self.pipeline.steady_columns.get(search)
        if columns is None or len(columns.slots) != count:
            columns = SteadyColumns(
                slots=[
                    self.tables.slot_of(hypothesis.request_id, hypothesis.blocks) for hypothesis in hypotheses
                ],
                fed=[_FED_FROM_LAST_STEP] * count,
                no_sot=[-1] * count,
                readers=_cross_readers_of(count, self.limit),
                not_first=[False] * count,
                timestamps=[search.window.options.timestamps] * count,
                temperatures=[0.0] * count,
            )
        self.steady[search] = columns
        return columns
