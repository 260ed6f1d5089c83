"""Choosing each row's next token: the logit rules, then greedy or temperature sampling, on the device."""

from __future__ import annotations

from dataclasses import dataclass

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
    stamp_rows = rules.timestamp_rows(first, timestamps, row_slots)
    rules.apply(row_logits, first, stamp_rows)
    generator_states = {
        r.request_id: r.generator.get_state()
        for r in requests
        if r.generator is not None and r.temperature > 0
    }
    tokens, logprobs = sample(row_logits, [r.temperature for r in requests], [r.generator for r in requests])
    rules.record(tokens, stamp_rows)
    return SampledRows(tokens, logprobs, row_index, generator_states)


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
