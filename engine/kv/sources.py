"""Where a request's cross-attention K/V comes from: loaded into its blocks at admission.

A source writes into the paged storage by block id; it never sees the decode loop. A source that
brings encoder states rather than K/V projects them with the decoder's weights, which the engine
passes in as ``project_states``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv.storage import PagedKVStorage

# Encoder states [frames, d_model] -> cross-attention K/V [layers, 2, frames, H, D] in the model's dtype.
StateProjection = Callable[[torch.Tensor], torch.Tensor]


class CrossKVSource(Protocol):
    # Whether loading waits on another process (a transfer): such a load runs beside the decode loop.
    travels: bool
    # Encoder frames the K/V covers: a full window's, or fewer for a window encoded over only the
    # audio it has (engine/encode/context.py). The decoder reserves and attends to that many.
    num_frames: int

    def load_into(
        self, storage: PagedKVStorage, block_ids: list[int], project_states: StateProjection
    ) -> None: ...

    def discard(self) -> None:
        """Give the K/V up unloaded (the request ended before admission); never raises."""


@dataclass
class CrossKVTensor:
    """Cross-attention K/V already computed in this process: [layers, 2, frames, H, D]."""

    cross_kv: torch.Tensor
    travels = False

    @property
    def num_frames(self) -> int:
        return self.cross_kv.shape[2]

    def load_into(
        self, storage: PagedKVStorage, block_ids: list[int], project_states: StateProjection
    ) -> None:
        storage.write_sequence(block_ids, self.cross_kv)

    def discard(self) -> None:
        pass  # an in-process tensor: freed with the request


@dataclass
class EncoderStates:
    """Encoder output [frames, d_model]; the decoder side projects it to cross K/V itself."""

    states: torch.Tensor
    travels = False

    @property
    def num_frames(self) -> int:
        return self.states.shape[0]

    def load_into(
        self, storage: PagedKVStorage, block_ids: list[int], project_states: StateProjection
    ) -> None:
        storage.write_sequence(block_ids, project_states(self.states))

    def discard(self) -> None:
        pass  # an in-process tensor: freed with the request
