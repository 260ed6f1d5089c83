"""A decode step's trip through the device: launched, then read.

Launching runs the forward, the logit rules and sampling, all queued on the device, and leaves the
tokens on their way to the host; reading waits for them. With async steps the engine reads a step
only after launching the next one (fed the tokens still on the device, through the runner's
``next_tokens``), so the host's work for one step overlaps the device's for the next, as
TensorRT-LLM's overlap scheduler and vLLM's async scheduling do. The price: a window that ends at
end of text has run one step too many, whose row is dropped when it is read (its ``epoch`` or its
finished status tells the row is stale), and its blocks are held until that step has been read
(the scheduler holds them: see ``Scheduler.finish``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.decode.beam_on_device import DeviceBeamChooser, DeviceChoices, SearchRows
from engine.decode.host_device import PendingDownload, upload
from engine.decode.language import detect_language, no_speech_probability
from engine.decode.logit_rules import LogitRules
from engine.decode.prompt import next_prompt_tokens
from engine.decode.request import FROM_LAST_STEP, Request
from engine.decode.runner import ModelRunner, StepInput
from engine.decode.sampling import RowsToSample, sample_rows
from engine.decode.search import Candidates, Search
from engine.decode.step_output import StepOutput
from engine.model.tokenizer import WhisperTokenizer

# Rows of a launched step's read-back: the token (sampled, or the detected language), its
# log-probability, and at <|startoftranscript|> the no-speech probability.
_TOKEN, _LOGPROB, _NO_SPEECH = range(3)


@dataclass
class LaunchedStep:
    """A step on its way through the device, and what reading its tokens back needs."""

    step_id: int
    batch: list[Request]
    epochs: list[int]  # each row's request.epoch at launch: a row of a window restarted since is stale
    sampling_rows: list[int]
    # Rows read token by token: every row but those of searches whose choice this step made on
    # the device (read as a whole, from the device's ranking).
    host_rows: list[int]
    sot_rows: list[int]  # rows that fed <|startoftranscript|>: their no-speech probability is read
    detect_rows: list[int]  # of those, rows whose language is detected there
    computed_after: list[int]  # each row's tokens in the cache once this step has run
    # [3, rows] float32: _TOKEN, _LOGPROB, _NO_SPEECH; then the device choices' rankings, if any.
    readback: PendingDownload
    hypothesis_rows: list[int] = field(default_factory=list)  # rows of hypotheses the host chooses for
    # [2, len(hypothesis_rows), width] float32: their candidate tokens and log-probabilities.
    candidates: PendingDownload | None = None
    # Per request that sampled with its own generator: the generator's state before this step's draw.
    generator_states: dict[str, torch.Tensor] = field(default_factory=dict)
    device_choices: DeviceChoices | None = None  # beam searches whose choice this step made on the device
    host_chooses: bool = False  # a search chooses from this step's candidates on the host: read it at once


class StepPipeline:
    def __init__(
        self,
        runner: ModelRunner,
        rules: LogitRules,
        tokenizer: WhisperTokenizer,
        n_text_ctx: int,
        stepped_prompt_tokens: int,
        async_steps: bool,
    ):
        self.runner = runner
        self.rules = rules
        self.tokenizer = tokenizer
        self.n_text_ctx = n_text_ctx
        self.stepped_prompt_tokens = stepped_prompt_tokens
        self.async_steps = async_steps
        self.in_flight: LaunchedStep | None = None  # launched and not read yet (async steps only)
        # With async steps, beam searches choose on the device (engine/decode/beam_on_device.py).
        self.beam_chooser = (
            DeviceBeamChooser(runner, rules, runner.tables.pad_slot + 1) if async_steps else None
        )
        self._step_ids = itertools.count()
        self._language_of_token = {token: code for code, token in tokenizer.language_tokens.items()}

    def next_prompt_tokens_of(self, request: Request) -> list[int]:
        return next_prompt_tokens(request, self.stepped_prompt_tokens)

    def steps_to_read(self, launched: LaunchedStep | None, overlap: bool = True) -> list[LaunchedStep]:
        """The steps whose tokens to read now, in launch order: the one just launched, or with async
        steps the one before. ``overlap=False`` reads both: a search chooses its next tokens on the
        host from the one just launched."""
        if not self.async_steps:
            return [launched] if launched is not None else []
        previous, self.in_flight = self.in_flight, (launched if overlap else None)
        steps = [previous] + ([] if overlap else [launched])
        return [step for step in steps if step is not None]

    def undo_draw(self, request: Request) -> torch.Tensor | None:
        """The request's generator state before the draw of the step in flight, if that step drew for it."""
        in_flight = self.in_flight
        if in_flight is None or request.launched_in != in_flight.step_id:
            return None
        return in_flight.generator_states.get(request.request_id)

    def _ends_with_unread_token(self, request: Request) -> bool:
        """Whether the token it sampled in the step in flight is its last by length: then it need
        not run again (a window ending at end of text cannot be told apart before reading)."""
        if not request.unread_tokens:
            return False
        search = request.hypothesis_of
        written = len(request.output_tokens) if search is None else search.text_length()
        return (
            written + request.unread_tokens >= request.max_tokens
            or request.num_computed_tokens + 1 >= self.n_text_ctx
        )

    def _still_to_step(self, scheduled: list[Request]) -> tuple[list[Request], dict[int, Search]]:
        """The scheduled requests that still need a step, and the row where each search's
        hypotheses start. A search's hypotheses are adjacent (all of them, in its order), read one
        window's K/V, and are at one length with as many tokens unread (they end together), so its
        first one answers for all of them."""
        batch: list[Request] = []
        searches: dict[int, Search] = {}
        row, count = 0, len(scheduled)
        while row < count:
            request = scheduled[row]
            search = request.hypothesis_of
            size = 1 if search is None else len(search.hypotheses)
            if (
                request.finish_reason is None
                and not request.waits_for_cross_kv
                and not self._ends_with_unread_token(request)
            ):
                if search is not None:
                    searches[len(batch)] = search
                batch += scheduled[row : row + size]
            row += size
        return batch, searches

    @torch.inference_mode()
    def launch(self, scheduled: list[Request]) -> LaunchedStep | None:
        """One decoder forward, logit rules and sampling for every request that still needs a step:
        not ended since it was scheduled, not waiting for its K/V (a pull started at its admission),
        not done by length with its last token still unread."""
        batch, searches = self._still_to_step(scheduled)
        if not batch:
            return None
        step_id = next(self._step_ids)
        plan = _StepPlan(self, batch, searches, step_id)
        logits = self.runner.execute(plan.step_input())
        to_sample = plan.to_sample
        readback = torch.zeros((3, len(batch)), dtype=torch.float32, device=self.runner.device)
        sampled = None
        if to_sample.rows:
            logprobs_out = None
            if plan.choosing:
                logprobs_out = self.beam_chooser.logprobs_buffer(len(to_sample.rows), logits.last.shape[1])
            sampled = sample_rows(self.rules, logits.last, to_sample, logprobs_out)
            if sampled.row_index is None:
                readback[_TOKEN] = sampled.tokens
                readback[_LOGPROB] = sampled.logprobs
            else:
                readback[_TOKEN].index_copy_(0, sampled.row_index, sampled.tokens.float())
                readback[_LOGPROB].index_copy_(0, sampled.row_index, sampled.logprobs.float())
        if plan.sot_rows:
            self._read_sot_logits(logits.at_sot, plan.sot_rows, plan.detect_rows, readback)
        if sampled is not None and sampled.row_index is None and not plan.sot_rows:
            self.runner.next_tokens[: len(batch)] = sampled.tokens  # every row sampled: no conversion
        else:
            self.runner.next_tokens[: len(batch)] = readback[_TOKEN].long()
        device_choices = None
        if plan.choosing:
            device_choices = self.beam_chooser.choose(step_id, plan.choosing, sampled.vocab_logprobs)
        host_chooses = bool(sampled and sampled.hypothesis_rows)
        return LaunchedStep(
            step_id=step_id,
            batch=batch,
            epochs=plan.epochs,
            sampling_rows=to_sample.rows,
            host_rows=plan.host_rows,
            sot_rows=plan.sot_rows,
            detect_rows=plan.detect_rows,
            computed_after=plan.computed_after,
            readback=PendingDownload(readback, *([device_choices.rankings] if device_choices else [])),
            generator_states=sampled.generator_states if sampled else {},
            hypothesis_rows=sampled.hypothesis_rows if sampled else [],
            candidates=PendingDownload(sampled.candidates) if host_chooses else None,
            device_choices=device_choices,
            host_chooses=host_chooses,
        )

    def step_input(self, batch: list[Request]) -> StepInput:
        """What the runner needs of ``batch`` this step: slots, fed tokens, positions (the
        benchmarks' way to a step's input; launching a step makes it along the way)."""
        return _StepPlan(self, batch, {}, step_id=None).step_input()

    def _read_sot_logits(
        self,
        at_sot: dict[int, torch.Tensor],
        sot_rows: list[int],
        detect_rows: list[int],
        readback: torch.Tensor,
    ) -> None:
        """No-speech probabilities, and detected languages, from the logits at <|startoftranscript|>."""
        device = self.runner.device
        sot_logits = torch.stack([at_sot[row] for row in sot_rows])
        readback[_NO_SPEECH].index_copy_(
            0, upload(sot_rows, torch.long, device), no_speech_probability(self.tokenizer, sot_logits)
        )
        if detect_rows:
            local = upload([sot_rows.index(row) for row in detect_rows], torch.long, device)
            languages = detect_language(self.tokenizer, sot_logits[local])
            readback[_TOKEN].index_copy_(0, upload(detect_rows, torch.long, device), languages.float())

    def read(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens."""
        values = step.readback.wait()
        tokens = values[_TOKEN].astype(np.int64).tolist()
        finite = np.isfinite(values[_LOGPROB])
        candidates = None
        if step.candidates is not None:
            offered = step.candidates.wait()
            # Copies: the pinned buffer goes back for reuse.
            candidates = Candidates(offered[0].astype(np.int64), offered[1].astype(np.float32))
        return StepOutput(
            step_id=step.step_id,
            batch=step.batch,
            epochs=step.epochs,
            tokens=tokens,
            logprobs=values[_LOGPROB].tolist(),
            sampled_rows=set(step.sampling_rows),
            host_rows=step.host_rows,
            nonfinite_rows=set() if finite.all() else set(np.flatnonzero(~finite).tolist()),
            no_speech_probs={row: float(values[_NO_SPEECH, row]) for row in step.sot_rows},
            languages={row: self._language_of_token[tokens[row]] for row in step.detect_rows},
            computed_after=step.computed_after,
            candidates=candidates,
            # Only for the host's choices: a choice made on the device comes with its ranking.
            candidate_index={row: index for index, row in enumerate(step.hypothesis_rows)}
            if candidates is not None
            else {},
            device_rankings=step.device_choices.read(step.readback.wait(1)) if step.device_choices else {},
        )


# A hypothesis row's fed tokens in a step after a choice made on the device (shared, never changed).
_FED_FROM_LAST_STEP = [FROM_LAST_STEP]


@functools.cache
def _cross_readers_of(hypotheses: int, limit: int) -> tuple[int, ...]:
    """A search's rows' cross-attention readers (StepInput.cross_readers): each run of up to
    ``limit`` rows is read once, counted by its first row."""
    return tuple(min(limit, hypotheses - index) if index % limit == 0 else 0 for index in range(hypotheses))


class _StepPlan:
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
        # Asked before any of its tokens of this step counts as unread.
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
        """A search whose last choice the device made: every hypothesis feeds one token (the
        device's, or the host's once that step was read) at one position, from adjacent rows of
        the last step, and samples; its block-table rows are the device's. Returns the row after
        its last."""
        hypotheses = search.hypotheses
        count = len(hypotheses)
        end = row + count
        if len(search.hypothesis_slots) != count:
            search.hypothesis_slots = [self.tables.slot_of(h.request_id, h.blocks) for h in hypotheses]
        slots = search.hypothesis_slots
        start = hypotheses[0].num_computed_tokens
        source = hypotheses[0].fed_from_row
        self.slots += slots
        if source >= 0:
            self.tokens += [_FED_FROM_LAST_STEP] * count
            self.sources += range(source, source + count)
        else:
            self.tokens += [hypothesis.pending_tokens for hypothesis in hypotheses]
            self.sources += [-1] * count
        self.starts += [start] * count
        self.sot_offsets += [-1] * count
        self.epochs += [hypotheses[0].epoch] * count
        if self.readers is not None:
            self.readers += _cross_readers_of(count, self.limit)
        computed = start + 1
        self.computed_after += [computed] * count
        on_device = search.chooses_on_device()  # before its tokens of this step count as unread
        to_sample = self.to_sample
        index = len(to_sample.rows)
        rows, sampled = range(row, end), range(index, index + count)
        to_sample.rows += rows
        to_sample.requests += hypotheses
        to_sample.slots += slots
        to_sample.first += [False] * count
        to_sample.timestamps += [search.window.options.timestamps] * count
        to_sample.temperatures += [0.0] * count
        to_sample.hypotheses += sampled
        if on_device:
            self.choosing.append(SearchRows(search, rows, sampled, slots, computed))
        else:
            to_sample.offering += sampled
            self.host_rows += rows
        step_id = self.step_id
        for fed_from, hypothesis in enumerate(hypotheses, row):
            hypothesis.num_computed_tokens = computed
            hypothesis.launched_in = step_id
            hypothesis.pending_tokens = [FROM_LAST_STEP] if on_device else []
            hypothesis.pending_source_row = fed_from
            hypothesis.unread_tokens += 1
        return end
