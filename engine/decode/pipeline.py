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

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.decode.beam_on_device import DeviceBeamChooser, DeviceChoices
from engine.decode.host_device import PendingDownload, upload
from engine.decode.language import detect_language, no_speech_probability
from engine.decode.logit_rules import LogitRules
from engine.decode.prompt import next_prompt_tokens
from engine.decode.request import Request
from engine.decode.runner import ModelRunner, StepInput
from engine.decode.sampling import sample_rows
from engine.decode.search import Candidates, Search
from engine.decode.steady_tail import SteadyTail
from engine.decode.step_output import StepOutput
from engine.decode.step_plan import StepPlan
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
    # Rows that sampled, but those of the steady tail (read from the device's ranking, never token
    # by token): what reading needs of them (StepOutput.sampled_rows).
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
        # The last step's steady tail (engine/decode/steady_tail.py): the next reuses it if it can.
        self._tail: SteadyTail | None = None
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
            tail = SteadyTail.of(steady, self.runner.tables, self.runner.max_cross_readers)
            self._tail = tail
        return tail

    @torch.inference_mode()
    def launch(self, scheduled: list[Request]) -> LaunchedStep | None:
        """One decoder forward, logit rules and sampling for every request that still needs a step:
        not ended since it was scheduled, not waiting for its K/V (a pull started at its admission),
        not done by length with its last token still unread."""
        batch, searches, tail = self._still_to_step(scheduled)
        if not batch:
            return None
        step_id = next(self._step_ids)
        plan = StepPlan(self, batch, searches, step_id, tail)
        logits = self.runner.execute(plan.step_input())
        to_sample = plan.to_sample
        readback = torch.zeros((3, len(batch)), dtype=torch.float32, device=self.runner.device)
        sampled = None
        # The steady tail's rows sample no token: the device chooses theirs (below).
        tail_from = plan.steady_rows.first_logit_row if plan.steady_rows is not None else None
        if to_sample.rows:
            sampled = sample_rows(self.rules, logits.last, to_sample, tail_from)
            count = len(sampled.tokens)
            if sampled.row_index is None:  # every row sampled, in order: the first ``count`` rows
                readback[_TOKEN, :count] = sampled.tokens
                readback[_LOGPROB, :count] = sampled.logprobs
            else:
                readback[_TOKEN].index_copy_(0, sampled.row_index[:count], sampled.tokens.float())
                readback[_LOGPROB].index_copy_(0, sampled.row_index[:count], sampled.logprobs.float())
        if plan.sot_rows:
            self._read_sot_logits(logits.at_sot, plan.sot_rows, plan.detect_rows, readback)
        if sampled is not None and sampled.row_index is None and not plan.sot_rows:
            # Every row sampled, or the tail's device choice writes the rest: no conversion.
            self.runner.next_tokens[: len(sampled.tokens)] = sampled.tokens
        else:
            self.runner.next_tokens[: len(batch)] = readback[_TOKEN].long()
        device_choices = None
        if plan.choosing or plan.steady_rows:
            device_choices = self.beam_chooser.choose(
                plan.choosing, plan.steady_rows, sampled.filtered_logits
            )
        host_chooses = bool(sampled and sampled.hypothesis_rows)
        return LaunchedStep(
            step_id=step_id,
            batch=batch,
            epochs=plan.epochs,
            sampling_rows=to_sample.rows[:tail_from],
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
        return StepPlan(self, batch, {}, step_id=None).step_input()

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
            device_rankings=step.device_choices.read(step.readback.wait(1)) if step.device_choices else None,
        )
