"""The attention backend interface: paged attention over a block-major KV cache.

Every backend answers the same question: for a batch of requests whose queries are packed
back to back (``query_start_loc``), attend over each request's keys and values, which live in
fixed-size blocks named by that request's row of ``block_tables``. Self-attention is causal
(query ``i`` of a request with ``q_len`` new tokens and ``seq_len`` total keys sits at position
``seq_len - q_len + i``); cross-attention sees all ``seq_len`` keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionBatch:
    """Per-step metadata shared by every layer's call (built once per step by the runner).

    query_start_loc: [B + 1] int32, offsets of each request's queries in the packed query tensor.
    seq_lens:        [B] int32, number of keys each request attends to (after this step's writes).
    block_tables:    [B, max_blocks] int32, block ids per request; entries past a request's
                     blocks are padding and must never be read unmasked.
    causal:          self-attention (True) or cross-attention (False).
    max_query_len, max_seq_len: host-side maxima, so kernels need no device sync to size grids.
    key_readers:     [B] int32 or None, a decode step's cross-attention only: how many requests
                     from this one on read this one's keys (its table and length; the beams of
                     one window), 0 for a request an earlier one's readers include. A hint: the
                     requests' own tables say the same, and a backend may ignore it, or read
                     each shared table once (at most ``max_key_readers`` readers per group).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    causal: bool
    max_query_len: int
    max_seq_len: int
    key_readers: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return self.seq_lens.numel()


class AttentionBackend(ABC):
    """One implementation of paged attention; all backends agree with TorchReferenceBackend."""

    name: str
    # Safe to capture in a CUDA graph: no host synchronization, no host-side reads of device data.
    graph_safe: bool = False
    # Reads a request's blocks faster where their ids are consecutive: the scheduler then asks the
    # pool for a window's cross-attention blocks as one run where it can.
    prefers_consecutive_blocks: bool = False

    def max_key_readers(self, num_heads: int, head_dim: int) -> int:
        """The most requests one group of ``PagedAttentionBatch.key_readers`` may hold; 1: the
        backend reads each request's keys on its own."""
        return 1

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedAttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        """query [T, H, D]; key_cache/value_cache [num_blocks, block_size, H, D] (may be strided
        views of the block-major cache, last dim contiguous). Returns [T, H, D] in query's dtype."""
