"""A step's rows, made from the requests that step in one pass: the Batch the step side launches
(engine/decode/batch.py), and each request moved on to after the step (its position, what it feeds
next, its unread tokens). The rows of beam searches whose last choice the device made come last,
as one steady tail (engine/decode/scheduler/steady_tail.py) whose columns are made when its searches
change."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from engine.decode.batch import FROM_LAST_STEP, Batch, SearchRows, SteadyRows, StepInput
from engine.decode.prompt import next_prompt_tokens
from engine.decode.request import Request
from engine.decode.scheduler.steady_tail import SteadyTail, cross_readers_of
from engine.decode.search.base import Search
from engine.kv.block_tables import DeviceBlockTables


@dataclass
class LaunchedRows:
    """What the scheduler keeps of a launched step to apply its output: each row's request, its
    epoch at launch (a row of a window restarted since is stale) and its tokens in the cache once
    the step has run, and the searches whose choice the step made on the device, in the order of
    the device's rankings."""

    requests: list[Request]
    epochs: list[int]
    computed_after: list[int]
    device_searches: list[Search] = field(default_factory=list)


class StepRows:
    def __init__(
        self,
        tables: DeviceBlockTables,
        cross_reader_limit: int,
        n_text_ctx: int,
        stepped_prompt_tokens: int,
        device_chooses: bool,
    ):
        """``device_chooses``: beam searches may choose on the device (with async steps)."""
        self.tables = tables
        self.limit = cross_reader_limit
        self.n_text_ctx = n_text_ctx
        self.stepped_prompt_tokens = stepped_prompt_tokens
        self.device_chooses = device_chooses
        self._step_ids = itertools.count()
        # The last step's steady tail: the next reuses it if it has the same searches.
        self._tail: SteadyTail | None = None

    def of(self, scheduled: list[Request]) -> tuple[Batch, LaunchedRows] | None:
        """The rows of the scheduled requests that still need a step (not ended since they were
        scheduled, not waiting for their K/V, not done by length with their last token still
        unread), each moved on to after it; None when none does."""
        batch, searches, tail = self._still_to_step(scheduled)
        if not batch:
            return None
        return _Pass(self, batch, searches, next(self._step_ids), tail).result()

    def step_input(self, requests: list[Request]) -> StepInput:
        """What the runner needs of ``requests`` this step, changing nothing (the benchmarks' way
        to a step's input)."""
        rows = _Pass(self, requests, {}, None)
        self.tables.rewrite_self(rows.rewrites)
        return rows.step_input()

    def _ends_with_unread_token(self, request: Request) -> bool:
        """Whether the token it sampled in the step in flight is its last by length: then it need
        not run again (a window ending at end of text cannot be told apart before reading)."""
        unread = request.unread_tokens
        return bool(unread) and (
            len(request.output_tokens) + unread >= request.max_tokens
            or request.num_computed_tokens + 1 >= self.n_text_ctx
        )

    def _still_to_step(
        self, scheduled: list[Request]
    ) -> tuple[list[Request], dict[int, Search], SteadyTail | None]:
        """The scheduled requests that still need a step, the row where each search's hypotheses
        start, and the steady tail: the searches whose last choice the device made go last, in
        their order. A search's hypotheses are adjacent (all of them, in its order), read one
        window's K/V, and are at one length with as many tokens unread (they end together), so its
        first one answers for all of them, and the search for its text's length."""
        batch: list[Request] = []
        searches: dict[int, Search] = {}
        steady: list[Search] = []
        row, count = 0, len(scheduled)
        while row < count:
            request = scheduled[row]
            search = request.hypothesis_of
            if search is None:
                if (
                    request.finish_reason is None
                    and not request.cross_kv_loading
                    and not self._ends_with_unread_token(request)
                ):
                    batch.append(request)
                row += 1
                continue
            size = len(search.hypotheses)
            if (
                request.finish_reason is None
                and not search.window.cross_kv_loading
                and not search.ends_with(request.unread_tokens)
            ):
                if search.host_chose_last:
                    searches[len(batch)] = search
                    batch += scheduled[row : row + size]
                else:
                    steady.append(search)
            row += size
        tail = self._tail_of(steady)
        if tail is not None:
            batch += tail.hypotheses
        return batch, searches, tail

    def _tail_of(self, steady: list[Search]) -> SteadyTail | None:
        """The steady tail of ``steady``: the last step's when it has the same searches."""
        if not steady:
            self._tail = None
            return None
        tail = self._tail
        if tail is None or not tail.same_searches(steady):
            tail = SteadyTail.of(steady, self.tables, self.limit)
            self._tail = tail
        return tail


class _Pass:
    """One pass over a step's rows: the Batch's columns, which rows sample and how, which searches
    choose on the device, and, when launching (``step_id`` given), each request moved on."""

    def __init__(
        self,
        rows: StepRows,
        batch: list[Request],
        searches: dict[int, Search],
        step_id: int | None,
        tail: SteadyTail | None = None,
    ):
        """``searches``: the row where each search's hypotheses start, of those before ``tail``,
        whose rows end ``batch``."""
        self.owner = rows
        self.tables = rows.tables
        self.step_id = step_id
        self.limit = rows.limit
        self.requests = batch
        self.rewrites: dict[int, list[int]] = {}
        self.slots: list[int] = []
        self.tokens: list[list[int]] = []
        self.sources: list[int] = []
        self.starts: list[int] = []
        self.sot_offsets: list[int] = []
        self.epochs: list[int] = []  # each row's request's epoch
        self.readers: list[int] | None = [] if self.limit > 1 and (searches or tail) else None
        self.computed_after: list[int] = []
        self.batch = Batch(step_id, None, self.rewrites)  # its input is made last
        self.device_searches: list[Search] = []
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
        return StepInput(self.slots, self.tokens, self.sources, self.starts, self.sot_offsets, self.readers)

    def result(self) -> tuple[Batch, LaunchedRows]:
        self.batch.input = self.step_input()
        launched = LaunchedRows(self.requests, self.epochs, self.computed_after, self.device_searches)
        return self.batch, launched

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
        batch = self.batch
        request.num_computed_tokens = computed
        request.launched_in = self.step_id
        if feeds_sot:
            batch.sot_rows.append(row)
        if feeds_sot and request.detect_language:
            # The rest of the prompt starts with the language detected here, on the device.
            batch.detect_rows.append(row)
            batch.detect_languages.append(request.options.languages)
            request.detect_language = False
            request.pending_tokens = next_prompt_tokens(request, self.owner.stepped_prompt_tokens)
            request.pending_tokens[0], request.pending_source_row = FROM_LAST_STEP, row
            batch.host_rows.append(row)
            return
        if computed < len(request.prompt_tokens):
            # The rest of the prompt (language, task, timestamp tokens) runs before any sampling.
            request.pending_tokens = next_prompt_tokens(request, self.owner.stepped_prompt_tokens)
            batch.host_rows.append(row)
            return
        to_sample = batch.to_sample
        first = not request.output_tokens and not request.unread_tokens
        timestamps = request.options.timestamps
        to_sample.rows.append(row)
        to_sample.generators.append(request.generator)
        to_sample.slots.append(slot)
        to_sample.first.append(first)
        to_sample.timestamps.append(timestamps)
        search = request.hypothesis_of
        to_sample.temperatures.append(request.temperature if search is None else 0.0)
        request.pending_source_row = row
        request.unread_tokens += 1
        batch.host_rows.append(row)
        if search is None:
            request.pending_tokens = [FROM_LAST_STEP]
            return
        # Its next token is its search's choice (``_add_search_row_by_row`` says where it is made).
        index = len(to_sample.rows) - 1
        to_sample.hypotheses.append(index)
        if timestamps and not first:
            # It takes over a forked parent's text: its slot's timestamp history follows that text.
            to_sample.restore_history.append(index)
            to_sample.restore_texts.append(request.output_tokens)

    def _add_search_row_by_row(self, batch: list[Request], row: int, search: Search) -> int:
        """A search whose last choice the host made (or that has made none): its hypotheses may
        differ in where they are (a prompt's rows, forks). Returns the row after its last."""
        end = row + len(search.hypotheses)
        to_sample = self.batch.to_sample
        sampled_before, host_before = len(to_sample.rows), len(self.batch.host_rows)
        may_choose_on_device = (
            self.step_id is not None and self.owner.device_chooses and search.chooses_on_device()
        )
        for index in range(row, end):
            self._add_row(batch[index], index)
        if self.readers is not None:
            self.readers += cross_readers_of(end - row, self.limit)
        if self.step_id is None:
            return end
        sampled = range(sampled_before, len(to_sample.rows))
        if may_choose_on_device and len(sampled) == end - row:
            hypotheses = batch[row:end]
            self.batch.choosing.append(
                SearchRows(
                    range(row, end),
                    sampled,
                    self.slots[row:end],
                    self.computed_after[row],
                    [hypothesis.sum_logprob for hypothesis in hypotheses],
                    search.text_end,
                    search.launch_device_choice(),
                )
            )
            self.device_searches.append(search)
            del self.batch.host_rows[host_before:]
            for hypothesis in hypotheses:
                hypothesis.pending_tokens = [FROM_LAST_STEP]
        elif sampled:
            to_sample.offering += sampled
            for index in sampled:
                hypothesis = batch[to_sample.rows[index]]
                hypothesis.pending_tokens = []  # chosen on the host once read
                to_sample.offering_wanted.append(search.candidates_wanted(hypothesis))
                to_sample.offering_temperatures.append(hypothesis.temperature)
                to_sample.offering_generators.append(hypothesis.generator)
        return end

    def _add_steady_tail(self, tail: SteadyTail, row: int) -> None:
        """The steady searches' rows, from ``row`` on: every hypothesis feeds one token (the
        device's, or the host's once that step was read) at its search's position, from its row of
        the last step, and samples; its block-table row is the device's."""
        columns, leaders = tail.columns, tail.leaders
        count = columns.num_rows
        positions = np.fromiter((leader.num_computed_tokens for leader in leaders), np.int64, len(leaders))
        # A search's hypotheses went in adjacent rows of the last step, in its order.
        sources = np.repeat(
            np.fromiter((leader.fed_from_row for leader in leaders), np.int64, len(leaders)),
            columns.beam_sizes,
        )
        starts = np.repeat(positions, columns.beam_sizes)
        self.slots += columns.slots
        if sources.min() >= 0:  # the usual step: every token still on the device
            self.tokens += columns.fed
            self.sources += (sources + columns.within).tolist()
        else:  # the host read the step before this one launched: some tokens are the host's
            source_rows = np.where(sources >= 0, sources + columns.within, -1).tolist()
            self.sources += source_rows
            self.tokens += [
                fed if source >= 0 else hypothesis.pending_tokens
                for fed, source, hypothesis in zip(columns.fed, source_rows, tail.hypotheses)
            ]
        self.starts += starts.tolist()
        self.sot_offsets += columns.no_sot
        self.epochs += tail.epochs
        if self.readers is not None:
            self.readers += columns.cross_readers
        self.computed_after += (starts + 1).tolist()
        if self.step_id is None:
            return
        to_sample = self.batch.to_sample
        index = len(to_sample.rows)
        to_sample.rows += range(row, row + count)
        to_sample.generators += columns.generators
        to_sample.slots += columns.slots
        to_sample.first += columns.not_first
        to_sample.timestamps += columns.timestamps
        to_sample.temperatures += columns.temperatures
        to_sample.hypotheses += range(index, index + count)
        after = positions + 1
        self.batch.steady = SteadyRows(columns, row, index, after)
        self.device_searches += tail.searches
        # A steady search's first hypothesis stands for all of them (engine/decode/search/base.py says why).
        step_id = self.step_id
        for leader, fed_from, computed_after in zip(
            leaders, (columns.first_hypotheses + row).tolist(), after.tolist()
        ):
            leader.num_computed_tokens = computed_after
            leader.launched_in = step_id
            leader.pending_tokens = [FROM_LAST_STEP]
            leader.pending_source_row = fed_from
            leader.unread_tokens += 1
