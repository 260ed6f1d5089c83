"""Whisper's timestamp rules as two Triton kernels: one applies them to a step's logits, one
records the sampled tokens into each slot's history (engine.decode.step.logit_rules.LogitRules uses
them on a GPU).

As PyTorch operations the rules take dozens of small kernels a step, whose launches cost the host
time: with async steps that is hidden behind a large model's step, but not behind a small model's
such as large-v3-turbo, whose step then grows markedly with timestamps on. One program per row works
out the row's bounds from its slot's history,
masks the row in place (no gather of the timestamp rows and no write back), and compares the
timestamps' log-sum-exp with the best text token on the raw logits (log-softmax's normaliser is
the same on both sides).

JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs them in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

if triton_available():

    def _apply_rules_kernel(
        LOGITS,
        stride_row,
        INDEX,
        stride_index,
        HISTORY,
        stride_history,
        vocab,
        begin,
        eot,
        no_timestamps,
        first_limit,
        BLOCK: tl.constexpr,
    ):
        # INDEX rows: 0 the logits row, 1 its slot, 2 whether this is the row's first sampled token.
        program = tl.program_id(0)
        row = tl.load(INDEX + program).to(tl.int64)
        slot = tl.load(INDEX + stride_index + program).to(tl.int64)
        first = tl.load(INDEX + 2 * stride_index + program) != 0
        last_was_stamp = (tl.load(HISTORY + slot) != 0) & ~first
        before_was_stamp = tl.load(HISTORY + stride_history + slot) != 0
        last_stamp = tl.load(HISTORY + 2 * stride_history + slot)
        n_stamps = vocab - begin
        closed_pair = last_was_stamp & before_was_stamp  # next must be text (or the end)
        open_segment = last_was_stamp & ~before_was_stamp  # next must close it (or end)
        after_stamp = ~first & ~last_was_stamp & (last_stamp >= 0)  # timestamps never go back
        # Forbidden timestamps, as offsets from ``begin``: [0, floor) and [limit, n_stamps).
        floor = tl.where(
            closed_pair,
            n_stamps,
            tl.where(open_segment, last_stamp - begin, tl.where(after_stamp, last_stamp + 1 - begin, 0)),
        )
        limit = tl.where(first, first_limit, n_stamps)
        text_end = tl.where(first, begin, tl.where(open_segment, eot, 0))  # text tokens forbidden below this
        base = LOGITS + row * stride_row
        text_max = tl.full([], float("-inf"), tl.float32)
        stamp_max = tl.full([], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            live = tokens < vocab
            values = tl.load(base + tokens, mask=live, other=float("-inf"))
            offsets = tokens - begin
            is_stamp = tokens >= begin
            forbidden = (
                (tokens == no_timestamps)
                | (tokens < text_end)
                | (is_stamp & ((offsets < floor) | (offsets >= limit)))
            )
            values = tl.where(forbidden, float("-inf"), values)
            tl.store(base + tokens, values, mask=live)
            text_max = tl.maximum(text_max, tl.max(tl.where(is_stamp, float("-inf"), values)))
            stamp_max = tl.maximum(stamp_max, tl.max(tl.where(is_stamp & live, values, float("-inf"))))
        # When timestamps together are likelier than any single text token, emit one.
        if stamp_max > float("-inf"):
            total = tl.zeros([], tl.float32)
            for start in range(begin, vocab, BLOCK):
                tokens = start + tl.arange(0, BLOCK)
                values = tl.load(base + tokens, mask=tokens < vocab, other=float("-inf"))
                total += tl.sum(tl.exp(values - stamp_max))
            if stamp_max + tl.log(total) > text_max:
                for start in range(0, begin, BLOCK):
                    tokens = start + tl.arange(0, BLOCK)
                    tl.store(base + tokens, tl.full([BLOCK], float("-inf"), tl.float32), mask=tokens < begin)

    def _record_kernel(TOKENS, INDEX, stride_index, HISTORY, stride_history, begin):
        # INDEX rows as above; row 0 is the token's position in TOKENS.
        program = tl.program_id(0)
        token = tl.load(TOKENS + tl.load(INDEX + program))
        slot = tl.load(INDEX + stride_index + program).to(tl.int64)
        first = tl.load(INDEX + 2 * stride_index + program) != 0
        last_was_stamp = tl.load(HISTORY + slot)
        last_stamp = tl.load(HISTORY + 2 * stride_history + slot)
        is_stamp = token >= begin
        # A first token has none before it: it counts as a timestamp (openai-whisper's rule).
        tl.store(HISTORY + stride_history + slot, tl.where(first, 1, last_was_stamp))
        tl.store(HISTORY + slot, is_stamp.to(tl.int64))
        tl.store(
            HISTORY + 2 * stride_history + slot, tl.where(is_stamp, token, tl.where(first, -1, last_stamp))
        )


_JITTED: dict[str, object] = {}


def _kernel(name: str):
    if name not in _JITTED:
        _JITTED[name] = triton.jit({"apply": _apply_rules_kernel, "record": _record_kernel}[name])
    return _JITTED[name]


def triton_apply_timestamp_rules(
    logits: torch.Tensor,
    index: torch.Tensor,
    history: torch.Tensor,
    begin: int,
    eot: int,
    no_timestamps: int,
    first_limit: int,
) -> None:
    """``logits`` [B, V] float32, in place, for the rows ``index[0]`` (slots ``index[1]``, first
    tokens where ``index[2]``); ``history`` [3, slots] int64; ``first_limit``: the first token's
    highest timestamp, as an offset from ``begin``, plus one."""
    _kernel("apply")[(index.shape[1],)](
        logits,
        logits.stride(0),
        index,
        index.stride(0),
        history,
        history.stride(0),
        logits.shape[1],
        begin,
        eot,
        no_timestamps,
        first_limit,
        BLOCK=1024,
        num_warps=4,
    )


def triton_record_timestamps(
    tokens: torch.Tensor, index: torch.Tensor, history: torch.Tensor, begin: int
) -> None:
    """The tokens ``tokens[index[0]]`` (int64) into the history of slots ``index[1]``."""
    _kernel("record")[(index.shape[1],)](
        tokens, index, index.stride(0), history, history.stride(0), begin, num_warps=1
    )
