"""The encoder's forward replayed from CUDA graphs, one per batch size bucket and context (the
encoder frames a window is encoded over: a full window's, and each shortened one in use,
engine/encode/context.py).

Why: launching a compiled 32-layer encoder is hundreds of kernels, each a Python call under the
GIL. Beside a decode loop in the same process (a colocated replica) the launching thread waits for
the GIL behind every decode step, and a forward takes several times its GPU time. A replay is one launch.

A batch runs in the smallest bucket (a power of two, up to the largest batch the caller will send)
that holds it; the rows past the batch hold whatever the bucket's input last held, which is
harmless: the encoder treats each window on its own. The output is copied out of the graph's
memory, because the next replay writes over it while a decoder may still read these states. All
graphs share one memory pool (they never run at once: one encoder stream replays them in turn).

They are captured on a stream of their own, not torch's default capture stream. PyTorch gives each
stream its own cuBLAS workspace, and a captured product keeps the workspace of the stream it was
captured on. On the default capture stream, the encoder's products would share a workspace with
the decode step's graphs (engine/decode/step/cuda_graphs.py), and two replays running at once on two
streams would write over each other's split-K scratch, which can hang the GPU with both streams waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


class EncoderGraphs:
    @torch.inference_mode()
    def __init__(
        self,
        encoder: nn.Module,
        n_mels: int,
        contexts: Sequence[int],
        max_batch_size: int,
        device: torch.device,
    ):
        """Captures ``encoder`` at each bucket size for each of ``contexts`` (encoder frames) on
        ``device``."""
        self.sizes = bucket_sizes(max_batch_size)
        self.contexts = frozenset(contexts)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # by (encoder frames, batch size)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        warmup = torch.cuda.Stream(device=device)
        warmup.wait_stream(torch.cuda.current_stream(device))
        capture = torch.cuda.Stream(device=device)  # its own cuBLAS workspace: see the module's doc
        pool = None
        # The largest first: the smaller ones fit in its memory.
        for frames in sorted(self.contexts, reverse=True):
            for size in reversed(self.sizes):
                mels = torch.zeros(size, n_mels, 2 * frames, device=device)  # two mel frames a frame
                # A compiled encoder runs its graph for this context (EncoderRunner.encode).
                torch._dynamo.mark_static(mels, 2)
                with torch.cuda.stream(warmup):
                    for _ in range(2):  # compiles and tunes this shape before it is captured
                        encoder(mels)
                torch.cuda.current_stream(device).wait_stream(warmup)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture):
                    self.outputs[frames, size] = encoder(mels)
                pool = graph.pool() if pool is None else pool
                self.inputs[frames, size], self.graphs[frames, size] = mels, graph

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def holds(self, mels: torch.Tensor) -> bool:
        """Whether a graph replays ``mels`` [N, n_mels, mel frames]: its context captured, N not
        past the largest bucket."""
        return mels.shape[-1] // 2 in self.contexts and len(mels) <= self.max_batch_size

    def __call__(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [N, n_mels, 2 * frames] that the graphs ``holds`` -> encoder states [N, frames, d],
        in memory of their own. Replays on the current stream."""
        count, frames = mels.shape[0], mels.shape[-1] // 2
        size = next(size for size in self.sizes if size >= count)
        self.inputs[frames, size][:count].copy_(mels)
        self.graphs[frames, size].replay()
        return self.outputs[frames, size][:count].clone()
