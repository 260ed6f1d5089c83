"""The transfer layer's one interface, used by both sides of the disaggregated pipeline.

Encoder side (``KVSender``): after an encoder batch, ``stage`` puts one request's payload into
bounded staging memory laid out as blocks, and returns a small serializable ``TransferHandle``.
Decoder side (``KVReceiver``): ``pull_blocks`` copies the staged blocks into the block ids the
decoder allocated in its paged cache (or ``pull_states`` fetches encoder states, in the
``encoder_states`` mode), then tells the sender to release the staging memory.

Block layout: a staged payload of shape [layers, 2, frames, H, D] is cut along frames into blocks
of ``block_size`` frames, block-major ([num_blocks, layers, 2, block_size, H, D], the last block
zero-padded), exactly as ``engine.kv_storage.PagedKVStorage`` stores a request's blocks; so block
i of the staging maps onto one contiguous block of the decoder's cache, and one READ moves it.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.errors import EngineError, RetriableError
from engine.kv_storage import PagedKVStorage

TransferPayload = Literal["cross_kv", "encoder_states"]


class TransferError(RetriableError):
    """A pull failed: the sender is gone, the handle expired, or the transport reported an error.
    Retriable: the request can be encoded again and decoded elsewhere."""


class StagingFullError(EngineError, RuntimeError):
    """The sender's staging memory stayed full for the whole wait: back-pressure to the caller."""


@dataclass(frozen=True)
class BlockLayout:
    """How a staged tensor is cut into blocks.

    cross_kv: ``shape`` = (layers, 2, frames, heads, head_dim), blocks along frames.
    encoder_states: ``shape`` = (frames, d_model), one region (block_size == frames).
    """

    payload: TransferPayload
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def num_frames(self) -> int:
        return self.shape[2] if self.payload == "cross_kv" else self.shape[0]

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_frames / self.block_size)

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.payload == "cross_kv":
            layers, two, _, heads, head_dim = self.shape
            return (layers, two, self.block_size, heads, head_dim)
        return (self.block_size, self.shape[1])

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class TransferHandle:
    """What the encoder side returns and the decoder side pulls with. Small and serializable:
    it travels through Ray Serve between deployments (never the payload itself)."""

    request_id: str
    connector: str  # "nixl" | "object_store" | "local"
    sender_id: str  # the staging owner (NIXL agent name, replica id): where to pull from, whom to release
    layout: BlockLayout
    location: Any  # connector-specific and serializable: NIXL descriptors, an ObjectRef, a staging key
    created_at_s: float  # time.time() at staging; handles never claimed are released after a timeout


class KVSender(abc.ABC):
    """Encoder side. One per encoder replica; staging memory is allocated (and registered) once."""

    @abc.abstractmethod
    def stage(self, request_id: str, payload: torch.Tensor, kind: TransferPayload) -> TransferHandle:
        """Copy ``payload`` into staging blocks and return its handle. Waits for space when the
        staging memory is full, up to the configured wait, then raises StagingFullError."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Free a request's staging (idempotent). Receivers normally trigger this after a pull."""

    @property
    @abc.abstractmethod
    def num_staged(self) -> int:
        """Requests whose staging is still held."""

    def close(self) -> None:
        """Free everything; the sender is unusable afterwards."""


class KVReceiver(abc.ABC):
    """Decoder side. One per decoder replica; pulls straight into the paged cache's blocks."""

    @abc.abstractmethod
    def pull_blocks(self, handle: TransferHandle, storage: PagedKVStorage, block_ids: list[int]) -> None:
        """Copy a cross_kv handle's blocks into ``storage`` at ``block_ids`` (one id per staged
        block), then release the sender's staging. Raises TransferError on any failure."""

    @abc.abstractmethod
    def pull_states(self, handle: TransferHandle) -> torch.Tensor:
        """Fetch an encoder_states handle's tensor [frames, d_model] onto the receiver's device,
        then release the sender's staging. Raises TransferError on any failure."""

    def close(self) -> None:
        """Free everything; the receiver is unusable afterwards."""

