"""How many encoder frames a window is encoded over.

Whisper's encoder was trained on 30 s windows, but nothing in it needs all 1500 frames: its
convolutions are local and its positional table is read from the start, so a window cut to its
first ``frames`` frames (the mel's first ``2 * frames``, the table's first ``frames`` rows) runs at
what that audio costs. whisper.cpp offers this as ``audio_ctx``. The states are not the first
frames of the full window's (the encoder's attention is global and the model never saw a short
window), so a shortened context trades some accuracy for cost: the live turn's partial passes take
it, final passes keep the full window (benchmarks/bench_partial_context.py measures the trade).

The cross-attention K/V of such a window is that many frames: its paged blocks are fewer (the last
one partly filled), and the decoder attends to exactly those frames (RequestBlocks.cross_len).
"""

from __future__ import annotations

import math

from engine.model.audio import CHUNK_LENGTH_S, HOP_LENGTH, N_FRAMES, SAMPLE_RATE

WINDOW_FRAMES = N_FRAMES // 2  # a full window's encoder frames: conv2 halves the mel frames
FRAMES_PER_S = WINDOW_FRAMES / CHUNK_LENGTH_S


def context_frames(num_samples: int, min_s: float, pad_s: float, step_s: int = 1) -> int:
    """The encoder frames for ``num_samples`` of 16 kHz audio: the audio and ``pad_s`` of the
    silence after it, at least ``min_s`` (very short contexts make Whisper hear words that are not
    there), rounded up to whole ``step_s`` seconds, at most a full window.

    Why a step: the encoder runs one shape per forward, so windows of different contexts never
    share one, and on a GPU a forward of many windows costs little more than a forward of one; a
    compiled encoder, or one replayed from CUDA graphs, also holds a graph per shape, made at
    start-up for every context in use (``context_buckets``). Coarser steps let concurrent passes
    share forwards and keep those graphs few, for up to a step of silence more than the audio needs.
    """
    step_frames = round(step_s * FRAMES_PER_S)
    seconds = max(num_samples / SAMPLE_RATE + pad_s, min_s)
    frames = math.ceil(seconds * FRAMES_PER_S / step_frames) * step_frames
    return min(WINDOW_FRAMES, max(step_frames, frames))


def context_buckets(min_s: float, pad_s: float, step_s: int = 1) -> list[int]:
    """Every count of encoder frames ``context_frames`` gives with these settings, shortest first,
    the full window last."""
    shortest = context_frames(0, min_s, pad_s, step_s)
    step_frames = round(step_s * FRAMES_PER_S)
    return [*range(shortest, WINDOW_FRAMES, step_frames), WINDOW_FRAMES]


def context_samples(frames: int) -> int:
    """The samples whose mel the encoder reads for ``frames`` encoder frames (two mel frames each)."""
    return 2 * frames * HOP_LENGTH
