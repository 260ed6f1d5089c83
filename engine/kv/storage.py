"""The KV cache tensors: one block-major tensor [num_blocks, layers, 2 (k|v), block_size, H, D].

Block-major keeps each block one contiguous region across all decoder layers, so the transfer
layer moves a request's cross-attention K/V as 12 large regions rather than hundreds of small
per-layer ones; attention kernels take per-layer strided views. Within a view, one block's keys
(block_size x H x D) are the piece read contiguously, so blocks are large (128 tokens by default):
with small blocks the reads of one layer jump across the whole pool, and cross-attention runs
markedly slower.

The cache may be stored in fp8 (engine.kv_cache_dtype); every K/V that enters it, or is staged
for it, goes through ``to_cache_dtype``.
"""

from __future__ import annotations

import torch

from engine.arith import ceil_div
from engine.device import upload
from engine.kernels import triton_available
from engine.kernels.block_copy import triton_copy_blocks
from engine.kernels.block_write import triton_write_sequence
from engine.kv.shared_blocks import BlockCopy


def to_cache_dtype(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kv`` in the KV cache's ``dtype``. Into fp8 the cast saturates: values beyond the format's
    finite range (+-448 for e4m3) clamp to it, where a plain ``.to`` gives NaN (seen with torch
    2.11 on CUDA and CPU from 470 up; torch 2.13's CPU cast happens to saturate) and one NaN key
    poisons every query that reads it. Device ops only, no host sync: it runs inside captured CUDA
    graphs."""
    if kv.dtype == dtype:
        return kv
    if dtype.is_floating_point and dtype.itemsize == 1:
        finfo = torch.finfo(dtype)
        kv = kv.clamp(finfo.min, finfo.max)
    return kv.to(dtype)


def split_into_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """One sequence's K/V [layers, 2, seq_len, H, D] -> block-major [num_blocks, layers, 2,
    block_size, H, D], the last block zero-padded: the layout of the cache and of transfer staging."""
    seq_len = kv.shape[2]
    num_blocks = ceil_div(seq_len, block_size)
    padded_len = num_blocks * block_size
    if padded_len > seq_len:
        kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, padded_len - seq_len))
    blocks = kv.reshape(kv.shape[0], 2, num_blocks, block_size, *kv.shape[3:])
    return blocks.permute(2, 0, 1, 3, 4, 5)


class PagedKVStorage:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.block_size = block_size
        self.num_layers = num_layers
        # One block past the pool's: the null block, which no request owns. Padded rows of a
        # captured decode batch write there, so they never touch a live request's K/V.
        self.null_block = num_blocks
        # Zero-filled: padded key slots are masked, but garbage NaNs could still leak through 0 * NaN.
        self.cache = torch.zeros(
            num_blocks + 1, num_layers, 2, block_size, num_heads, head_dim, dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers * 2 * block_size * num_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def layer_cache(self, layer: int) -> torch.Tensor:
        """One layer's keys and values, [num_blocks, 2 (k|v), block_size, H, D] (strided)."""
        return self.cache[:, layer]

    def write_sequence(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write one request's K/V for all layers, kv [layers, 2, seq_len, H, D] (any strides, any
        device), into its blocks; the last block's unused slots are zeroed.

        On a GPU one Triton kernel writes every block (engine/kernels/block_write.py). Elsewhere,
        one copy per block, cast on the way, rather than padding, reordering into blocks and
        scattering the whole sequence: each of those is a full pass over the request's K/V."""
        seq_len = kv.shape[2]
        num_blocks = ceil_div(seq_len, self.block_size)
        if num_blocks != len(block_ids):
            raise ValueError(f"{seq_len} tokens fill {num_blocks} blocks, but {len(block_ids)} were given")
        if self.cache.is_cuda and triton_available() and kv.stride(4) == 1 and kv.stride(3) == kv.shape[4]:
            triton_write_sequence(self.cache, block_ids, kv.to(self.cache.device))
            return
        for index, block in enumerate(block_ids):
            start = index * self.block_size
            filled = min(self.block_size, seq_len - start)
            self.cache[block, :, :, :filled] = to_cache_dtype(
                kv[:, :, start : start + filled], self.cache.dtype
            )
            if filled < self.block_size:
                self.cache[block, :, :, filled:] = 0

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write whole blocks [len(block_ids), layers, 2, block_size, H, D] (already block-major)."""
        index = torch.tensor(block_ids, device=self.cache.device)
        self.cache[index] = to_cache_dtype(blocks.to(self.cache.device), self.cache.dtype)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy each copy's written positions (every layer's K and V) source -> target, all in one
        call: a beam that forks inside a block gets its own copy before it writes there."""
        if not copies:
            return
        index = upload(
            [
                [copy.source for copy in copies],
                [copy.target for copy in copies],
                [copy.positions for copy in copies],
            ],
            torch.long,
            self.cache.device,
        )
        self.copy_blocks_on_device(index[0], index[1], index[2], max(copy.positions for copy in copies))

    def copy_blocks_on_device(
        self, sources: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, most: int
    ) -> None:
        """As ``copy_blocks``, with the ids and counts already on the cache's device (a copy of 0
        positions copies nothing), ``most`` their largest count. On a GPU one Triton kernel
        (engine/kernels/block_copy.py); on another GPU one masked gather and scatter, with no read
        of the counts on the host; on a CPU a slice copy per copy."""
        if most <= 0 or len(sources) == 0:
            return
        if self.cache.is_cuda and triton_available():
            triton_copy_blocks(self.cache, sources, targets, positions, most)
            return
        if not self.cache.is_cuda:  # reading the counts costs a CPU nothing: copy what they say only
            for source, target, count in zip(sources.tolist(), targets.tolist(), positions.tolist()):
                if count:
                    self.cache[target, :, :, :count] = self.cache[source, :, :, :count]
            return
        written = torch.arange(most, device=self.cache.device)[None, :] < positions[:, None]
        keep = written[:, None, None, :, None, None]
        target_view = self.cache[targets, :, :, :most]
        self.cache[targets, :, :, :most] = torch.where(keep, self.cache[sources, :, :, :most], target_view)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks, [len(block_ids), layers, 2, block_size, H, D]."""
        return self.cache[torch.tensor(block_ids, device=self.cache.device)]
