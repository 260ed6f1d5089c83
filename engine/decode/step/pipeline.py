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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.decode.batch import Batch, StepInput
from engine.decode.step.beam_choice import DeviceBeamChooser, DeviceChoices
from engine.decode.step.language import detect_language, no_speech_probability
from engine.decode.step.logit_rules import LogitRules
from engine.decode.step.output import Candidates, StepOutput
from engine.decode.step.runner import ModelRunner
from engine.decode.step.sampling import sample_rows
from engine.device import PendingDownload, upload
from engine.model.tokenizer import WhisperTokenizer

# Rows of a launched step's read-back: the token (sampled, or the detected language), its
# log-probability, and at <|startoftranscript|> the no-speech probability.
_TOKEN, _LOGPROB, _NO_SPEECH = range(3)


@dataclass
class LaunchedStep:
    """A step on its way through the device, and what reading its tokens back needs."""

    step_id: int
    batch: Batch
    # Rows that sampled, but those of the steady tail (read from the device's ranking, never token
    # by token): what reading needs of them (StepOutput.sampled_rows).
    sampling_rows: list[int]
    # Rows read token by token: every row but those of searches whose choice this step made on
    # the device (read as a whole, from the device's ranking).
    host_rows: list[int]
    sot_rows: list[int]  # rows that fed <|startoftranscript|>: their no-speech probability is read
    detect_rows: list[int]  # of those, rows whose language is detected there
    # [3, rows] float32: _TOKEN, _LOGPROB, _NO_SPEECH; then the device choices' rankings, if any.
    readback: PendingDownload
    hypothesis_rows: list[int] = field(default_factory=list)  # rows of hypotheses the host chooses for
    # [2, len(hypothesis_rows), width] float32: their candidate tokens and log-probabilities.
    candidates: PendingDownload | None = None
    # Per generator a row sampled with: its state before this step's draw.
    generator_states: dict[torch.Generator, torch.Tensor] = field(default_factory=dict)
    device_choices: DeviceChoices | None = None  # beam searches whose choice this step made on the device
    host_chooses: bool = False  # a search chooses from this step's candidates on the host: read it at once


class StepPipeline:
    def __init__(
        self,
        runner: ModelRunner,
        rules: LogitRules,
        tokenizer: WhisperTokenizer,
        async_steps: bool,
        describe_rows: Callable[[list], StepInput] | None = None,
    ):
        """``describe_rows``: the scheduler's description of some requests' rows, changing nothing
        (``step_input``, the benchmarks' way to a step's input)."""
        self.runner = runner
        self.rules = rules
        self.tokenizer = tokenizer
        self.async_steps = async_steps
        self._describe_rows = describe_rows
        self.in_flight: LaunchedStep | None = None  # launched and not read yet (async steps only)
        # With async steps, beam searches choose on the device (engine/decode/step/beam_choice.py).
        self.beam_chooser = (
            DeviceBeamChooser(runner, rules, runner.tables.pad_slot + 1) if async_steps else None
        )
        self._language_of_token = {token: code for code, token in tokenizer.language_tokens.items()}
        self._language_index = {code: index for index, code in enumerate(tokenizer.language_tokens)}

    def steps_to_read(self, launched: LaunchedStep | None, overlap: bool = True) -> list[LaunchedStep]:
        """The steps whose tokens to read now, in launch order: the one just launched, or with async
        steps the one before. ``overlap=False`` reads both: a search chooses its next tokens on the
        host from the one just launched."""
        if not self.async_steps:
            return [launched] if launched is not None else []
        previous, self.in_flight = self.in_flight, (launched if overlap else None)
        steps = [previous] + ([] if overlap else [launched])
        return [step for step in steps if step is not None]

    def draw_undone(self, generator: torch.Generator | None, launched_in: int) -> torch.Tensor | None:
        """A generator's state before the draw of the step in flight, if that step (``launched_in``,
        the last one launched with its request) drew from it."""
        in_flight = self.in_flight
        if in_flight is None or generator is None or launched_in != in_flight.step_id:
            return None
        return in_flight.generator_states.get(generator)

    @torch.inference_mode()
    def launch(self, batch: Batch | None) -> LaunchedStep | None:
        """One decoder forward, logit rules and sampling for the batch's rows."""
        if batch is None:
            return None
        self.runner.tables.rewrite_self(batch.table_rewrites)
        logits = self.runner.execute(batch.input)
        to_sample = batch.to_sample
        num_rows = batch.input.num_rows
        readback = torch.zeros((3, num_rows), dtype=torch.float32, device=self.runner.device)
        sampled = None
        # The steady tail's rows sample no token: the device chooses theirs (below).
        tail_from = batch.steady.first_logit_row if batch.steady is not None else None
        if to_sample.rows:
            sampled = sample_rows(self.rules, logits.last, to_sample, tail_from)
            count = len(sampled.tokens)
            if sampled.row_index is None:  # every row sampled, in order: the first ``count`` rows
                readback[_TOKEN, :count] = sampled.tokens
                readback[_LOGPROB, :count] = sampled.logprobs
            else:
                readback[_TOKEN].index_copy_(0, sampled.row_index[:count], sampled.tokens.float())
                readback[_LOGPROB].index_copy_(0, sampled.row_index[:count], sampled.logprobs.float())
        if batch.sot_rows:
            self._read_sot_logits(logits.at_sot, batch, readback)
        if sampled is not None and sampled.row_index is None and not batch.sot_rows:
            # Every row sampled, or the tail's device choice writes the rest: no conversion.
            self.runner.next_tokens[: len(sampled.tokens)] = sampled.tokens
        else:
            self.runner.next_tokens[:num_rows] = readback[_TOKEN].long()
        device_choices = None
        if batch.choosing or batch.steady:
            device_choices = self.beam_chooser.choose(batch.choosing, batch.steady, sampled.filtered_logits)
        host_chooses = bool(sampled and sampled.hypothesis_rows)
        return LaunchedStep(
            step_id=batch.step_id,
            batch=batch,
            sampling_rows=to_sample.rows[:tail_from],
            host_rows=batch.host_rows,
            sot_rows=batch.sot_rows,
            detect_rows=batch.detect_rows,
            readback=PendingDownload(readback, *([device_choices.rankings] if device_choices else [])),
            generator_states=sampled.generator_states if sampled else {},
            hypothesis_rows=sampled.hypothesis_rows if sampled else [],
            candidates=PendingDownload(sampled.candidates) if host_chooses else None,
            device_choices=device_choices,
            host_chooses=host_chooses,
        )

    def step_input(self, requests: list) -> StepInput:
        """What the runner needs of ``requests`` this step: slots, fed tokens, positions (the
        benchmarks' way to a step's input; the scheduler makes it, as it makes a Batch)."""
        return self._describe_rows(requests)

    def _read_sot_logits(self, at_sot: dict[int, torch.Tensor], batch: Batch, readback: torch.Tensor) -> None:
        """No-speech probabilities, and detected languages, from the logits at <|startoftranscript|>."""
        device = self.runner.device
        sot_rows, detect_rows = batch.sot_rows, batch.detect_rows
        sot_logits = torch.stack([at_sot[row] for row in sot_rows])
        readback[_NO_SPEECH].index_copy_(
            0, upload(sot_rows, torch.long, device), no_speech_probability(self.tokenizer, sot_logits)
        )
        if detect_rows:
            local = upload([sot_rows.index(row) for row in detect_rows], torch.long, device)
            allowed = self._allowed_languages(batch.detect_languages)
            languages = detect_language(self.tokenizer, sot_logits[local], allowed)
            readback[_TOKEN].index_copy_(0, upload(detect_rows, torch.long, device), languages.float())

    def _allowed_languages(self, detect_languages: list[tuple[str, ...] | None]) -> torch.Tensor | None:
        """The languages each detect row may be detected as, as detect_language's mask; None when
        every row may be detected as any."""
        if all(languages is None for languages in detect_languages):
            return None
        allowed = np.ones((len(detect_languages), len(self._language_index)), dtype=bool)
        for row, languages in enumerate(detect_languages):
            if languages is not None:
                allowed[row] = False
                allowed[row, [self._language_index[code] for code in languages]] = True
        return upload(allowed, torch.bool, self.runner.device)

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
            tokens=tokens,
            logprobs=values[_LOGPROB].tolist(),
            sampled_rows=set(step.sampling_rows),
            host_rows=step.host_rows,
            nonfinite_rows=set() if finite.all() else set(np.flatnonzero(~finite).tolist()),
            no_speech_probs={row: float(values[_NO_SPEECH, row]) for row in step.sot_rows},
            languages={row: self._language_of_token[tokens[row]] for row in step.detect_rows},
            candidates=candidates,
            # Only for the host's choices: a choice made on the device comes with its ranking.
            candidate_index={row: index for index, row in enumerate(step.hypothesis_rows)}
            if candidates is not None
            else {},
            device_rankings=step.device_choices.read(step.readback.wait(1)) if step.device_choices else None,
        )
