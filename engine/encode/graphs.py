"""The encoder's forward replayed from CUDA graphs, one per batch size bucket.

Why: launching a compiled 32-layer encoder is hundreds of kernels, each a Python call under the
GIL. Beside a decode loop in the same process (a colocated replica) the launching thread waits for
the GIL behind every decode step, and a forward takes several times its GPU time. A replay is one launch.

A batch runs in the smallest bucket (a power of two, up to the largest batch the caller will send)
that holds it; the rows past the batch hold whatever the bucket's input last held, which is
harmless: the encoder treats each window on its own. The output is copied out of the graph's
memory, because the next replay writes over it while a decoder may still read these states. All
buckets share one memory pool (they never run at once: one encoder stream replays them in turn).

They are captured on a stream of their own, not torch's default capture stream. PyTorch gives each
stream its own cuBLAS workspace, and a captured product keeps the workspace of the stream it was
captured on. On the default capture stream, the encoder's products would share a workspace with
the decode step's graphs (engine/decode/step/cuda_graphs.py), and two replays running at once on two
streams would write over each other's split-K scratch, which can hang the GPU with both streams waiting.
"""

from __future__ import annotations

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
        self, encoder: nn.Module, mel_shape: tuple[int, int], max_batch_size: int, device: torch.device
    ):
        """Captures ``encoder`` at each bucket size on ``device``; ``mel_shape``: (n_mels, frames)."""
        self.sizes = bucket_sizes(max_batch_size)
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        warmup = torch.cuda.Stream(device=device)
        warmup.wait_stream(torch.cuda.current_stream(device))
        capture = torch.cuda.Stream(device=device)  # its own cuBLAS workspace: see the module's doc
        pool = None
        for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory
            mels = torch.zeros(size, *mel_shape, device=device)
            with torch.cuda.stream(warmup):
                for _ in range(2):  # compiles and tunes this shape before it is captured
                    encoder(mels)
            torch.cuda.current_stream(device).wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture):
                self.outputs[size] = encoder(mels)
            pool = graph.pool() if pool is None else pool
            self.inputs[size], self.graphs[size] = mels, graph

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def __call__(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [N, n_mels, frames], N at most max_batch_size -> encoder states [N, frames/2, d], in
        memory of their own. Replays on the current stream."""
        count = mels.shape[0]
        size = next(size for size in self.sizes if size >= count)
        self.inputs[size][:count].copy_(mels)
        self.graphs[size].replay()
        return self.outputs[size][:count].clone()
