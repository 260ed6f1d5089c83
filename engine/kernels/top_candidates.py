"""Each beam hypothesis's likeliest tokens, best first, as two Triton kernels: the candidates a beam
search chooses from (engine/decode/sampling.py; ``torch.topk`` elsewhere).

``torch.topk`` over a step's rows costs the host several times a small kernel's launch (its
multi-block radix select launches several kernels), and its tokens and log-probabilities then
take a gather and a stack more. Here:

* every (log-probability, token) pair is one int64 key whose order is the candidates' order: the
  float's bits made order-preserving as a signed integer in the high half, the token counted down
  from the top in the low half (so of equal log-probabilities the lower token ranks first). One
  integer max finds the best pair of a tile, where a float max and an argmax would take two
  reductions;
* a row is cut into chunks of a few tiles, one program per (row, chunk), so that a step's rows
  fill the GPU (one program per row left most of it idle while each walked its whole row). A
  program finds its chunk's ``width`` best in as many passes over the chunk (which stays in L1/L2
  between passes), each taking the best key below the last one found;
* a second kernel merges each row's chunks' best into its ``width`` best and writes tokens and
  log-probabilities straight into the candidates' layout.

JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.kernels import tl, triton, triton_available

_BLOCK = 1024  # keys per tile
_TILES_PER_CHUNK = 4
_CHUNK_WARPS = 4

if triton_available():
    # Below every key a pair makes (the least has a nonzero low half), and above every one.
    _NO_KEY = tl.constexpr(-(2**63))
    _ABOVE_ALL = tl.constexpr(2**63 - 1)
    _TOKEN_TOP = tl.constexpr(2**31 - 1)

    def _chunk_best_kernel(
        LOGPROBS,
        stride_row,
        ROWS,
        vocab,
        chunk_size,
        BEST,
        width,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        NUM_CHUNKS: tl.constexpr,
    ):
        program = tl.program_id(0)
        chunk = tl.program_id(1)
        row = tl.load(ROWS + program).to(tl.int64) if HAS_ROWS else program.to(tl.int64)
        values = LOGPROBS + row * stride_row
        start = chunk * chunk_size
        end = tl.minimum(start + chunk_size, vocab)
        no_key = tl.full((), _NO_KEY, tl.int64)
        last = tl.full((), _ABOVE_ALL, tl.int64)
        token_top = tl.full((), _TOKEN_TOP, tl.int64)
        best_out = BEST + (program.to(tl.int64) * NUM_CHUNKS + chunk) * width
        for rank in range(0, width):
            best = no_key
            for tile in range(start, end, BLOCK):
                tokens = tile + tl.arange(0, BLOCK)
                value = tl.load(values + tokens, mask=tokens < end, other=0.0)
                bits = value.to(tl.int32, bitcast=True)
                ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                key = (ordered.to(tl.int64) << 32) | (token_top - tokens.to(tl.int64))
                key = tl.where((tokens < end) & (key < last), key, no_key)
                best = tl.maximum(best, tl.max(key, axis=0))
            tl.store(best_out + rank, best)
            last = best

    def _merge_chunks_kernel(
        BEST,
        OUT,
        stride_plane,
        stride_candidate,
        width,
        NUM_CHUNKS: tl.constexpr,
        KEYS_PAD: tl.constexpr,
    ):
        program = tl.program_id(0).to(tl.int64)
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
            tl.store(out + rank, token.to(tl.float32))
            tl.store(out + stride_plane + rank, bits.to(tl.float32, bitcast=True))
            last = best


_JITTED: dict[str, object] = {}


def triton_top_candidates(logprobs: torch.Tensor, rows: torch.Tensor | None, width: int) -> torch.Tensor:
    """For the rows ``rows`` [H] (int64, on the device; None: every row) of ``logprobs`` [R, V]
    float32 (last dimension contiguous): each row's ``width`` likeliest tokens, best first, as
    [2, H, width] float32: the tokens (as floats) and their log-probabilities."""
    if not _JITTED:
        _JITTED["chunks"] = triton.jit(_chunk_best_kernel)
        _JITTED["merge"] = triton.jit(_merge_chunks_kernel)
    count = len(logprobs) if rows is None else len(rows)
    vocab = logprobs.shape[1]
    chunk_size = _BLOCK * _TILES_PER_CHUNK
    num_chunks = ceil_div(vocab, chunk_size)
    best = torch.empty((count, num_chunks, width), dtype=torch.int64, device=logprobs.device)
    out = torch.empty((2, count, width), dtype=torch.float32, device=logprobs.device)
    if count == 0:
        return out
    _JITTED["chunks"][(count, num_chunks)](
        logprobs,
        logprobs.stride(0),
        logprobs if rows is None else rows,
        vocab,
        chunk_size,
        best,
        width,
        HAS_ROWS=rows is not None,
        BLOCK=_BLOCK,
        NUM_CHUNKS=num_chunks,
        num_warps=_CHUNK_WARPS,
    )
    _JITTED["merge"][(count,)](
        best,
        out,
        out.stride(0),
        out.stride(1),
        width,
        NUM_CHUNKS=num_chunks,
        KEYS_PAD=triton.next_power_of_2(num_chunks * width),
        num_warps=1,
    )
    return out
