"""Each beam hypothesis's likeliest tokens, best first, as one Triton kernel: the candidates a beam
search chooses from (engine/decode/sampling.py; ``torch.topk`` elsewhere).

``torch.topk`` over a step's rows costs the host several times a small kernel's launch (its
multi-block radix select launches several kernels), and its tokens and log-probabilities then
take a gather and a stack more. One program per row here finds the row's ``width`` best in as
many passes over the row (which stays in L2 between passes), each pass taking the best of what
ranks after the last one found (a lower log-probability, or the same one at a later token: ties
go to the lower token id), and writes tokens and log-probabilities straight into the candidates'
layout.

JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton, triton_available

_BLOCK = 2048

if triton_available():

    def _top_candidates_kernel(
        LOGPROBS,
        stride_row,
        ROWS,
        vocab,
        OUT,
        stride_plane,
        stride_candidate,
        width,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        program = tl.program_id(0)
        row = tl.load(ROWS + program).to(tl.int64) if HAS_ROWS else program.to(tl.int64)
        values = LOGPROBS + row * stride_row
        last_value = tl.full((), float("inf"), tl.float32)
        last_token = tl.full((), -1, tl.int32)
        for rank in range(0, width):
            best_value = tl.full((), -float("inf"), tl.float32)
            best_token = tl.full((), 0, tl.int32) + vocab
            for start in range(0, vocab, BLOCK):
                tokens = start + tl.arange(0, BLOCK)
                value = tl.load(values + tokens, mask=tokens < vocab, other=-float("inf"))
                after_last = (value < last_value) | ((value == last_value) & (tokens > last_token))
                value = tl.where(after_last, value, -float("inf"))
                top = tl.max(value, axis=0)
                at = tl.argmax(value, axis=0) + start
                # Strictly better only: an earlier block's token is the lower id.
                better = top > best_value
                best_token = tl.where(better, at, best_token)
                best_value = tl.where(better, top, best_value)
            out = OUT + program * stride_candidate + rank
            tl.store(out, best_token.to(tl.float32))
            tl.store(out + stride_plane, best_value)
            last_value = best_value
            last_token = best_token


_JITTED: dict[str, object] = {}


def triton_top_candidates(logprobs: torch.Tensor, rows: torch.Tensor | None, width: int) -> torch.Tensor:
    """For the rows ``rows`` [H] (int64, on the device; None: every row) of ``logprobs`` [R, V]
    float32 (last dimension contiguous): each row's ``width`` likeliest tokens, best first, as
    [2, H, width] float32: the tokens (as floats) and their log-probabilities."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_top_candidates_kernel)
    count = len(logprobs) if rows is None else len(rows)
    out = torch.empty((2, count, width), dtype=torch.float32, device=logprobs.device)
    _JITTED["kernel"][(count,)](
        logprobs,
        logprobs.stride(0),
        logprobs if rows is None else rows,
        logprobs.shape[1],
        out,
        out.stride(0),
        out.stride(1),
        width,
        HAS_ROWS=rows is not None,
        BLOCK=_BLOCK,
        num_warps=8,
    )
    return out
