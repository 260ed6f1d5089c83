"""Cache blocks' leading positions copied source -> target by one Triton kernel: the copy a beam
hypothesis takes of a block it shares before it writes there (engine/kv/shared_blocks.py).

A block holds every layer's keys and values for ``block_size`` positions, one contiguous run of
the cache (megabytes for large-v3): [layers, 2 (k|v), block_size, H, D]. A copy moves only the
positions written so far, the first ``positions`` of each layer's keys and of its values (on
average half a block). PyTorch's indexed assignment gathers the sources into a temporary and
scatters it back with a per-element index kernel, at a fraction of the memory bandwidth; this
kernel moves each piece as wide words, straight from source to target. The cache is copied as raw
words of the widest size a position's bytes divide into, so every cache dtype (fp8 included)
takes the same path. JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``)
runs it in tests.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.kernels import tl, triton, triton_available

# Words per program: up to 16 KiB, enough to keep loads in flight.
_CHUNK_WORDS = 4096

if triton_available():

    def _copy_blocks_kernel(
        CACHE, SOURCES, TARGETS, POSITIONS, block_words, plane_words, position_words, CHUNK: tl.constexpr
    ):
        # One program: one chunk of one layer's keys or values (a plane) of one copy.
        copy = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        source = tl.load(SOURCES + copy).to(tl.int64)
        target = tl.load(TARGETS + copy).to(tl.int64)
        length = tl.load(POSITIONS + copy).to(tl.int64) * position_words
        offsets = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        inside = offsets < length
        within = plane * plane_words + offsets
        words = tl.load(CACHE + source * block_words + within, mask=inside)
        tl.store(CACHE + target * block_words + within, words, mask=inside)


_JITTED: dict[str, object] = {}
_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def triton_copy_blocks(
    cache: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, most: int
) -> None:
    """Copy the first ``positions[i]`` positions of block ``sources[i]`` into block ``targets[i]``
    of ``cache`` [num_blocks, layers, 2, block_size, ...] (contiguous), every layer's K and V; the
    ids and counts on the cache's device, ``most`` their largest count. No target may be a source
    of the same call."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_copy_blocks_kernel)
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    num_layers, _, block_size = cache.shape[1:4]
    position_bytes = cache[0, 0, 0, 0].numel() * cache.element_size()
    word_bytes = next(size for size in _WORDS if position_bytes % size == 0)
    words = cache.view(-1).view(torch.uint8).view(_WORDS[word_bytes])
    position_words = position_bytes // word_bytes
    plane_words = block_size * position_words
    _JITTED["kernel"][(len(sources), num_layers * 2, ceil_div(most * position_words, _CHUNK_WORDS))](
        words,
        sources,
        targets,
        positions,
        num_layers * 2 * plane_words,
        plane_words,
        position_words,
        CHUNK=_CHUNK_WORDS,
        num_warps=4,
    )
