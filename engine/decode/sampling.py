"""Choosing each row's next token: the logit rules, then greedy or temperature sampling, on the device;
a beam hypothesis's row offers its likeliest tokens for the beams to choose from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.decode.host_device import upload
from engine.decode.logit_rules import LogitRules
from engine.decode.request import Request


@dataclass
class SampledRows:
    """What sampling some rows of a step produced, still on the device."""

    tokens: torch.Tensor  # [rows] long
    logprobs: torch.Tensor  # [rows] float32
    row_index: torch.Tensor | None  # the rows on the device; None when every row of the step sampled
    # Per request that drew from its own generator: the generator's state before this draw, so a
    # fallback restart can undo a draw made by a step launched ahead of the host's reading.
    generator_states: dict[str, torch.Tensor]
    beam_rows: list[int] = field(default_factory=list)  # the step's rows of beam hypotheses
    # [2, len(beam_rows), beam width] float32: their likeliest tokens (as floats) and log-probabilities.
    candidates: torch.Tensor | None = None


def sample_rows(
    rules: LogitRules, logits: torch.Tensor, slots: list[int], batch: list[Request], rows: list[int]
) -> SampledRows:
    """The logit rules and sampling for the rows ``rows`` of a step's logits [B, V]."""
    requests = [batch[row] for row in rows]
    every_row = len(rows) == len(batch)
    row_index = None if every_row else upload(rows, torch.long, logits.device)
    row_logits = logits if every_row else logits[row_index]  # the usual step samples every row: no gather
    first = [not r.output_tokens and not r.unread_tokens for r in requests]
    timestamps = [r.options.timestamps for r in requests]
    row_slots = slots if every_row else [slots[row] for row in rows]
    hypotheses = [index for index, r in enumerate(requests) if r.hypothesis_of is not None]
    # A hypothesis takes over a forked parent's text: its slot's timestamp history follows that text.
    stamped = [index for index in hypotheses if timestamps[index] and not first[index]]
    if stamped:
        rules.restore_histories(
            [row_slots[index] for index in stamped], [requests[index].output_tokens for index in stamped]
        )
    stamp_rows = rules.timestamp_rows(first, timestamps, row_slots)
    rules.apply(row_logits, first, stamp_rows)
    generator_states = {
        r.request_id: r.generator.get_state()
        for r in requests
        if r.generator is not None and r.temperature > 0
    }
    tokens, logprobs = sample(row_logits, [r.temperature for r in requests], [r.generator for r in requests])
    rules.record(tokens, stamp_rows)
    sampled = SampledRows(tokens, logprobs, row_index, generator_states)
    if hypotheses:
        width = max(requests[index].options.beam_size for index in hypotheses) + 1
        local = upload(hypotheses, torch.long, logits.device)
        top = torch.log_softmax(row_logits[local], dim=-1).topk(width, dim=-1)
        sampled.beam_rows = [rows[index] for index in hypotheses]
        sampled.candidates = torch.stack([top.indices.float(), top.values])
    return sampled


def sample(
    logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature 0 take the argmax; others sample from softmax(logits / T).

    Returns the tokens [B] and their log-probabilities under the rule-filtered logits [B]."""
    tokens = logits.argmax(dim=-1)
    for row, (temperature, generator) in enumerate(zip(temperatures, generators)):
        if temperature > 0:
            # NaN logits (an overflow, failed when read) must not reach multinomial: on a GPU it
            # asserts on the device, which ends the process.
            probs = torch.softmax(torch.nan_to_num(logits[row] / temperature, nan=0.0), dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs
