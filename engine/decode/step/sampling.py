"""Choosing each row's next token: the logit rules, then greedy or temperature sampling, on the device;
a search's hypothesis offers candidates for its search to choose from (engine/decode/search/base.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.decode.batch import RowsToSample
from engine.decode.step.logit_rules import LogitRules
from engine.device import upload
from engine.kernels import triton_available
from engine.kernels.top_candidates import triton_top_candidates


@dataclass
class SampledRows:
    """What sampling some rows of a step produced, still on the device."""

    tokens: torch.Tensor  # [rows] long
    logprobs: torch.Tensor  # [rows] float32
    row_index: torch.Tensor | None  # the rows on the device; None when every row of the step sampled
    # Per generator a row drew from: its state before this draw, so a fallback restart can undo a
    # draw made by a step launched ahead of the host's reading.
    generator_states: dict[torch.Generator, torch.Tensor]
    # The step's rows of hypotheses that offer candidates (their search chooses on the host).
    hypothesis_rows: list[int] = field(default_factory=list)
    # [2, len(hypothesis_rows), width] float32: their candidate tokens (as floats) and log-probabilities.
    candidates: torch.Tensor | None = None
    # [rows, vocab] float32: the sampled rows' logits with the rules applied (a search that chooses
    # on the device takes its candidates from there).
    filtered_logits: torch.Tensor | None = None


def sample_rows(
    rules: LogitRules,
    logits: torch.Tensor,
    to_sample: RowsToSample,
    chosen_on_device_from: int | None = None,
) -> SampledRows:
    """The logit rules and sampling for the rows ``to_sample`` of a step's logits [B, V]; hypotheses
    offer candidates where ``to_sample.offering`` says. From index ``chosen_on_device_from`` of
    ``to_sample.rows`` on, the rows are hypotheses the device chooses for from their filtered logits
    (the steady tail: engine/decode/scheduler/steady_tail.py): the rules apply to them, but they sample no
    token, so the returned tokens and log-probabilities stop there."""
    rows, first, timestamps = to_sample.rows, to_sample.first, to_sample.timestamps
    every_row = len(rows) == logits.shape[0]
    row_index = None if every_row else upload(rows, torch.long, logits.device)
    row_logits = logits if every_row else logits[row_index]  # the usual step samples every row: no gather
    # A hypothesis takes over a forked parent's text: its slot's timestamp history follows that text,
    # restored here when the host chose it (a choice made on the device moves histories there).
    if to_sample.restore_history:
        rules.restore_histories(
            [to_sample.slots[index] for index in to_sample.restore_history], to_sample.restore_texts
        )
    stamp_rows = rules.timestamp_rows(first, timestamps, to_sample.slots)
    rules.apply(row_logits, first, stamp_rows)
    if to_sample.hypotheses and stamp_rows is not None:
        # A hypothesis's history moves on with the token its search chooses, not its likeliest one.
        unchosen = list(timestamps)
        for index in to_sample.hypotheses:
            unchosen[index] = False
        stamp_rows = rules.timestamp_rows(first, unchosen, to_sample.slots)
    temperatures = to_sample.temperatures
    generator_states = {}
    generators: list[torch.Generator | None] = []
    if max(temperatures) > 0:
        generators = to_sample.generators
        generator_states = {
            generator: generator.get_state()
            for generator, temperature in zip(generators, temperatures)
            if temperature > 0 and generator
        }
    # One log-softmax serves the sampled tokens' log-probabilities and the host's candidates.
    sampling = slice(chosen_on_device_from)
    row_logprobs = torch.log_softmax(row_logits[sampling], dim=-1)
    tokens, logprobs = sample(
        row_logits[sampling], row_logprobs, temperatures[sampling], generators[sampling]
    )
    rules.record(tokens, stamp_rows)
    sampled = SampledRows(tokens, logprobs, row_index, generator_states, filtered_logits=row_logits)
    offering = to_sample.offering
    if offering:
        sampled.hypothesis_rows = [rows[index] for index in offering]
        sampled.candidates = _candidates(row_logits, row_logprobs, to_sample, offering)
    return sampled


def _candidates(
    logits: torch.Tensor, logprobs: torch.Tensor, to_sample: RowsToSample, rows: list[int]
) -> torch.Tensor:
    """Each hypothesis's candidates [2, H, width]: at temperature 0 its likeliest tokens, best first;
    above it its draws from softmax(logits / T), with its own generator. Log-probabilities are of
    the rule-filtered logits (``logprobs``, their log-softmax), as openai-whisper scores both."""
    some_rows = len(rows) < len(logits)  # greedy rows share the step: only the hypotheses' rows
    row_index = upload(rows, torch.long, logits.device) if some_rows else None
    wanted, temperatures = to_sample.offering_wanted, to_sample.offering_temperatures
    if not any(temperatures):
        return top_candidates(logits, row_index, max(wanted), logprobs)
    if some_rows:
        logprobs = logprobs[row_index]
    tokens = logprobs.topk(max(wanted), dim=-1).indices
    for index, (temperature, count, generator) in enumerate(
        zip(temperatures, wanted, to_sample.offering_generators)
    ):
        if temperature > 0:
            probs = torch.softmax(torch.nan_to_num(logits[rows[index]] / temperature, nan=0.0), dim=-1)
            tokens[index, :count] = torch.multinomial(probs, count, replacement=True, generator=generator)
    return _with_logprobs(tokens, logprobs)


def top_candidates(
    logits: torch.Tensor, rows: torch.Tensor | None, width: int, logprobs: torch.Tensor | None = None
) -> torch.Tensor:
    """The rows ``rows`` (on the device; None: every row) of the filtered ``logits`` [R, V]: each
    one's ``width`` likeliest tokens, best first, as [2, H, width] float32 (tokens as floats, their
    log-probabilities). On a GPU one pass over the logits (engine/kernels/top_candidates.py);
    elsewhere topk of ``logprobs`` (their log-softmax, made here if not given)."""
    if logits.is_cuda and triton_available():
        return triton_top_candidates(logits, rows, width)
    if logprobs is None:
        logprobs = torch.log_softmax(logits if rows is None else logits[rows], dim=-1)
    elif rows is not None:
        logprobs = logprobs[rows]
    return _with_logprobs(logprobs.topk(width, dim=-1).indices, logprobs)


def _with_logprobs(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Candidate ``tokens`` [H, width] with their log-probabilities of ``logprobs`` [H, V], as
    [2, H, width] float32."""
    return torch.stack([tokens.float(), logprobs.gather(1, tokens)])


def sample(
    logits: torch.Tensor,
    logprobs: torch.Tensor,
    temperatures: list[float],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature 0 take the argmax; others sample from softmax(logits / T), with the
    row's generator (``generators`` may be empty when every temperature is 0).

    ``logprobs`` is the log-softmax of ``logits``. Returns the tokens [B] and their
    log-probabilities under the rule-filtered logits [B]."""
    tokens = logits.argmax(dim=-1)
    if not generators:
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
    for row, (temperature, generator) in enumerate(zip(temperatures, generators)):
        if temperature > 0:
            # NaN logits (an overflow, failed when read) must not reach multinomial: on a GPU it
            # asserts on the device, which ends the process.
            probs = torch.softmax(torch.nan_to_num(logits[row] / temperature, nan=0.0), dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
