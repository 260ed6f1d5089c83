"""Each beam hypothesis's likeliest tokens, best first, with their log-probabilities, straight from a
step's rule-filtered logits, as two Triton kernels: the candidates a beam search chooses from
(engine/decode/step/sampling.py; ``torch.topk`` of the log-softmax elsewhere).

A log-softmax of every row and then a top-k over it read each row several times and write it once
in between; a beam step has five rows a window, so those passes were most of its choice's cost.
Here each row is read once:

* a row is cut into chunks, one program per (row, chunk), so that a step's rows fill the GPU. A
  program loads its chunk into registers once, and from them takes the chunk's maximum and its
  sum of exponentials (the log-softmax's two reductions, in the way an online softmax merges
  them) and its ``width`` best tokens;
* every (logit, token) pair is one int64 key whose order is the candidates' order: the float's
  bits made order-preserving as a signed integer in the high half, the token counted down from
  the top in the low half (so of equal logits the lower token ranks first). One integer max finds
  the best pair left, where a float max and an argmax would take two reductions;
* a second kernel merges each row's chunks: their maxima and sums into the row's log-sum-exp, and
  their best into the row's ``width`` best, written with ``logit - max - log(sum)`` (a
  log-softmax's arithmetic) straight into the candidates' layout.

A row of NaN logits (an overflow) gives NaN log-probabilities, so the choice's sums show it.
JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.kernels import tl, triton, triton_available

_CHUNK = 4096  # logits a program holds in registers
_CHUNK_WARPS = 8

if triton_available():
    # Below every key a pair makes (the least has a nonzero low half), and above every one.
    _NO_KEY = tl.constexpr(-(2**63))
    _ABOVE_ALL = tl.constexpr(2**63 - 1)
    _TOKEN_TOP = tl.constexpr(2**31 - 1)

    def _chunk_best_kernel(
        LOGITS,
        stride_row,
        ROWS,
        vocab,
        BEST,
        STATS,
        width,
        HAS_ROWS: tl.constexpr,
        CHUNK: tl.constexpr,
        NUM_CHUNKS: tl.constexpr,
    ):
        program = tl.program_id(0)
        chunk = tl.program_id(1)
        row = tl.load(ROWS + program).to(tl.int64) if HAS_ROWS else program.to(tl.int64)
        tokens = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = tokens < vocab
        value = tl.load(LOGITS + row * stride_row + tokens, mask=inside, other=-float("inf"))
        # The chunk's share of the log-softmax: its maximum and its sum of exp(logit - maximum)
        # (nothing when every logit is -inf: a chunk of suppressed tokens).
        most = tl.max(value, axis=0)
        shifted = tl.where(most == -float("inf"), -float("inf"), value - most)
        total = tl.sum(tl.exp(shifted), axis=0)
        pair = program.to(tl.int64) * NUM_CHUNKS + chunk
        tl.store(STATS + pair * 2, most)
        tl.store(STATS + pair * 2 + 1, total)
        no_key = tl.full((), _NO_KEY, tl.int64)
        token_top = tl.full((), _TOKEN_TOP, tl.int64)
        bits = value.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (token_top - tokens.to(tl.int64))
        key = tl.where(inside, key, no_key)
        last = tl.full((), _ABOVE_ALL, tl.int64)
        best_out = BEST + pair * width
        for rank in range(0, width):
            best = tl.max(tl.where(key < last, key, no_key), axis=0)
            tl.store(best_out + rank, best)
            last = best

    def _merge_chunks_kernel(
        BEST,
        STATS,
        OUT,
        stride_plane,
        stride_candidate,
        width,
        NUM_CHUNKS: tl.constexpr,
        CHUNKS_PAD: tl.constexpr,
        KEYS_PAD: tl.constexpr,
    ):
        program = tl.program_id(0).to(tl.int64)
        chunks = tl.arange(0, CHUNKS_PAD)
        stats = STATS + (program * NUM_CHUNKS + chunks) * 2
        maxima = tl.load(stats, mask=chunks < NUM_CHUNKS, other=-float("inf"))
        sums = tl.load(stats + 1, mask=chunks < NUM_CHUNKS, other=0.0)
        most = tl.max(maxima, axis=0)
        scale = tl.where(maxima == -float("inf"), 0.0, tl.exp(maxima - most))
        log_total = tl.log(tl.sum(sums * scale, axis=0))
        offsets = tl.arange(0, KEYS_PAD)
        count = NUM_CHUNKS * width
        no_key = tl.full((), _NO_KEY, tl.int64)
        keys = tl.load(BEST + program * count + offsets, mask=offsets < count, other=_NO_KEY)
        last = tl.full((), _ABOVE_ALL, tl.int64)
        out = OUT + program * stride_candidate
        for rank in range(0, width):
            best = tl.max(tl.where(keys < last, keys, no_key), axis=0)
            ordered = (best >> 32).to(tl.int32)
            bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
            token = tl.full((), _TOKEN_TOP, tl.int64) - (best & 0xFFFFFFFF)
            logit = bits.to(tl.float32, bitcast=True)
            tl.store(out + rank, token.to(tl.float32))
            tl.store(out + stride_plane + rank, (logit - most) - log_total)
            last = best


_JITTED: dict[str, object] = {}


def triton_top_candidates(logits: torch.Tensor, rows: torch.Tensor | None, width: int) -> torch.Tensor:
    """For the rows ``rows`` [H] (int64, on the device; None: every row) of ``logits`` [R, V]
    float32 (last dimension contiguous; the logit rules applied): each row's ``width`` likeliest
    tokens, best first, as [2, H, width] float32: the tokens (as floats) and their
    log-probabilities (of the row's log-softmax)."""
    if not _JITTED:
        _JITTED["chunks"] = triton.jit(_chunk_best_kernel)
        _JITTED["merge"] = triton.jit(_merge_chunks_kernel)
    count = len(logits) if rows is None else len(rows)
    vocab = logits.shape[1]
    num_chunks = ceil_div(vocab, _CHUNK)
    best = torch.empty((count, num_chunks, width), dtype=torch.int64, device=logits.device)
    stats = torch.empty((count, num_chunks, 2), dtype=torch.float32, device=logits.device)
    out = torch.empty((2, count, width), dtype=torch.float32, device=logits.device)
    if count == 0:
        return out
    _JITTED["chunks"][(count, num_chunks)](
        logits,
        logits.stride(0),
        logits if rows is None else rows,
        vocab,
        best,
        stats,
        width,
        HAS_ROWS=rows is not None,
        CHUNK=_CHUNK,
        NUM_CHUNKS=num_chunks,
        num_warps=_CHUNK_WARPS,
    )
    _JITTED["merge"][(count,)](
        best,
        stats,
        out,
        out.stride(0),
        out.stride(1),
        width,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        KEYS_PAD=triton.next_power_of_2(num_chunks * width),
        num_warps=1,
    )
    return out
