"""The transfer layer's one interface, used by both sides of the disaggregated pipeline.

Encoder side (``KVSender``): after an encoder batch, ``stage`` puts one request's payload into
bounded staging memory laid out as blocks, and returns a small serializable ``TransferHandle``.
Decoder side (``KVReceiver``): ``pull_blocks`` copies the staged blocks into the block ids the
decoder allocated in its paged cache (or ``pull_states`` fetches encoder states, in the
``encoder_states`` mode), then tells the sender to release the staging memory.

Block layout: a staged payload of shape [layers, 2, frames, H, D] is cut along frames into blocks
of ``block_size`` frames, block-major ([num_blocks, layers, 2, block_size, H, D], the last block
zero-padded), exactly as ``engine.kv.storage.PagedKVStorage`` stores a request's blocks; so block
i of the staging maps onto one contiguous block of the decoder's cache, and one READ moves it.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.errors import EngineError, RetriableError
from engine.kv.storage import PagedKVStorage, split_into_blocks

TransferPayload = Literal["cross_kv", "encoder_states"]


class TransferError(RetriableError):
    """A pull failed: the sender is gone, the handle expired, or the transport reported an error.
    Retriable: the request can be encoded again and decoded elsewhere."""


class StagingFullError(EngineError, RuntimeError):
    """The sender's staging memory stayed full for the whole wait: back-pressure to the caller."""


class IncompatibleHandleError(EngineError, ValueError):
    """A handle this receiver cannot pull (another connector) or whose blocks do not fit its cache
    (block size, shape or dtype differ): encoder and decoder were configured differently. Not
    retriable; the message names what differs."""


@dataclass(frozen=True)
class BlockLayout:
    """How a staged tensor is cut into blocks.

    cross_kv: ``shape`` = (layers, 2, frames, heads, head_dim), blocks along frames.
    encoder_states: ``shape`` = (frames, d_model), one region (block_size == frames).
    """

    payload: TransferPayload
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16", "float8_e4m3fn"
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

    @property
    def staged_shape(self) -> tuple[int, ...]:
        """Shape of the staged tensor: block-major blocks for cross_kv, the states as they are."""
        if self.payload == "cross_kv":
            return (self.num_blocks, *self.block_shape)
        return self.shape

    @classmethod
    def of(cls, payload: torch.Tensor, kind: TransferPayload, block_size: int) -> "BlockLayout":
        expected_dims = 5 if kind == "cross_kv" else 2
        if payload.dim() != expected_dims:
            raise ValueError(f"a {kind} payload has {expected_dims} dims, got shape {tuple(payload.shape)}")
        dtype = str(payload.dtype).removeprefix("torch.")
        if kind == "cross_kv":
            return cls(kind, tuple(payload.shape), dtype, block_size)
        return cls(kind, tuple(payload.shape), dtype, payload.shape[0])

    def to_staged(self, payload: torch.Tensor) -> torch.Tensor:
        """The payload in its staged form (a view where possible; the caller copies it once)."""
        return split_into_blocks(payload, self.block_size) if self.payload == "cross_kv" else payload

    def check_fits(self, storage: PagedKVStorage, block_ids: list[int]) -> None:
        """Raise IncompatibleHandleError unless these blocks land, byte for byte, in ``storage``'s blocks."""
        if self.payload != "cross_kv":
            raise IncompatibleHandleError(f"pull_blocks needs a cross_kv handle, got {self.payload}")
        cache = storage.cache
        if self.block_shape != tuple(cache.shape[1:]) or self.torch_dtype != cache.dtype:
            raise IncompatibleHandleError(
                f"staged blocks are {self.block_shape} {self.dtype}, "
                f"the cache's are {tuple(cache.shape[1:])} {str(cache.dtype).removeprefix('torch.')}: "
                "encoder and decoder need the same model, "
                "engine.block_size, engine.dtype and engine.kv_cache_dtype"
            )
        if len(block_ids) != self.num_blocks:
            raise IncompatibleHandleError(
                f"{self.num_blocks} staged blocks, but {len(block_ids)} block ids given"
            )


@dataclass(frozen=True)
class TransferHandle:
    """What the encoder side returns and the decoder side pulls with. Small and serializable:
    it travels through Ray Serve between deployments (never the payload itself)."""

    request_id: str
    connector: str  # "nixl" | "object_store" | "local"
    sender_id: str  # the staging owner (NIXL agent name, replica id): where to pull from, whom to release
    layout: BlockLayout
    location: Any  # connector-specific, serializable: NixlLocation, ObjectStoreLocation, None (local)
    created_at_s: float  # time.time() at staging; handles never claimed are released after a timeout
    staging_token: int  # which staged entry: unique per sender, so a stale handle never reads a reused region


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

    @classmethod
    @abc.abstractmethod
    def staged_bytes(cls, layout: BlockLayout) -> int:
        """The staging memory one payload of ``layout`` takes, with its header and alignment."""

    @abc.abstractmethod
    def holds_at_once(self, layout: BlockLayout) -> int:
        """How many payloads of ``layout`` the staging memory holds together, none pulled meanwhile."""

    def close(self) -> None:
        """Free everything; the sender is unusable afterwards."""


class KVReceiver(abc.ABC):
    """Decoder side. One per decoder replica; pulls straight into the paged cache's blocks."""

    connector: str  # the handles it pulls: TransferHandle.connector

    def check_connector(self, handle: TransferHandle) -> None:
        if handle.connector != self.connector:
            raise IncompatibleHandleError(
                f"a {handle.connector} handle reached a {self.connector} receiver: "
                "encoder and decoder need the same transfer.connector"
            )

    @abc.abstractmethod
    def pull_blocks(self, handle: TransferHandle, storage: PagedKVStorage, block_ids: list[int]) -> None:
        """Copy a cross_kv handle's blocks into ``storage`` at ``block_ids`` (one id per staged
        block), then release the sender's staging. Raises TransferError when the transfer fails
        (sender gone, handle expired or released, transport error, timeout) and
        IncompatibleHandleError when the blocks cannot fit; either way the sender's staging is
        released (for a handle of another connector, by its unclaimed timeout)."""

    @abc.abstractmethod
    def pull_states(self, handle: TransferHandle) -> torch.Tensor:
        """Fetch an encoder_states handle's tensor [frames, d_model] onto the receiver's device,
        then release the sender's staging. Raises TransferError when the transfer fails."""

    @abc.abstractmethod
    def discard(self, handle: TransferHandle) -> None:
        """Release the sender's staging for a handle that will never be pulled (its request was
        aborted or rejected before admission), now rather than at unclaimed_timeout_s. Best
        effort: never raises (a sender already gone took its staging with it)."""

    def close(self) -> None:
        """Free everything; the receiver is unusable afterwards."""
