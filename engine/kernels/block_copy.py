"""Whole cache blocks copied source -> target by one Triton kernel: the copy a beam hypothesis
takes of a block it shares before it writes there (engine/kv/shared_blocks.py).

A block holds every layer's keys and values for ``block_size`` positions, one contiguous run of
the cache (megabytes for large-v3). PyTorch's indexed assignment gathers the sources into a
temporary and scatters it back with a per-element index kernel, at a fraction of the memory
bandwidth; this kernel moves each block as wide words, straight from source to target. The cache
is copied as raw 32-bit words, so every cache dtype (fp8 included) takes the same path.
JIT-decorated on first use, so Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs it in tests.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.kernels import tl, triton, triton_available

# 32-bit words per program: 16 KiB, enough to keep loads in flight, few programs per block.
_CHUNK_WORDS = 4096

if triton_available():

    def _copy_blocks_kernel(CACHE, SOURCES, TARGETS, block_words, CHUNK: tl.constexpr):
        # One program: one chunk of one copy's block.
        copy = tl.program_id(0)
        source = tl.load(SOURCES + copy).to(tl.int64)
        target = tl.load(TARGETS + copy).to(tl.int64)
        offsets = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        inside = offsets < block_words
        words = tl.load(CACHE + source * block_words + offsets, mask=inside)
        tl.store(CACHE + target * block_words + offsets, words, mask=inside)


_JITTED: dict[str, object] = {}


def triton_copy_blocks(cache: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy blocks ``sources[i]`` -> ``targets[i]`` of ``cache`` [num_blocks, ...] (contiguous), the
    ids on the cache's device. No target may be a source of the same call."""
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_copy_blocks_kernel)
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    block_bytes = cache[0].numel() * cache.element_size()
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not whole 32-bit words")
    words = cache.view(-1).view(torch.uint8).view(torch.int32)
    block_words = block_bytes // 4
    _JITTED["kernel"][(len(sources), ceil_div(block_words, _CHUNK_WORDS))](
        words, sources, targets, block_words, CHUNK=_CHUNK_WORDS, num_warps=4
    )
