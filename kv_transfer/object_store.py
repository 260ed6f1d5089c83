"""Ray object store connector, for where NIXL is absent: the sender ``ray.put``s each staged
payload and a small ledger actor hands it out exactly once.

The ledger is what makes the object store behave like staging: a claim pops the entry (a second
pull, or one after expiry or release, finds nothing and fails), and the sender's service thread
long-polls it for claims to free its budget. The ledger and the objects are owned by the sender's
process, so they vanish with it and a pull from a dead sender fails rather than hangs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch

from engine.kv.storage import PagedKVStorage
from kv_transfer.base import IncompatibleHandleError, KVReceiver, TransferError, TransferHandle
from kv_transfer.config import TransferConfig
from kv_transfer.staging import StagedEntry, StagingSender

logger = logging.getLogger(__name__)

# How long the sender's release poll waits in the ledger for a claim; it returns at once on one.
_CLAIM_POLL_S = 0.25


@ray.remote(num_cpus=0)
class StagingLedger:
    """Staged ObjectRefs by token. Holding each ref (wrapped in a list, so Ray passes the ref
    itself rather than its value) keeps the payload alive until it is claimed or dropped."""

    def __init__(self):
        self._staged: dict[int, ray.ObjectRef] = {}
        self._claimed: list[int] = []
        self._claim_seen = asyncio.Event()

    async def add(self, token: int, wrapped_ref: list) -> None:
        self._staged[token] = wrapped_ref[0]

    async def claim(self, token: int) -> list | None:
        ref = self._staged.pop(token, None)
        if ref is None:
            return None
        self._claimed.append(token)
        self._claim_seen.set()
        return [ref]

    async def drop(self, token: int) -> None:
        self._staged.pop(token, None)

    async def wait_claimed(self, timeout_s: float) -> list[int]:
        if not self._claimed:
            try:
                await asyncio.wait_for(self._claim_seen.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        claimed, self._claimed = self._claimed, []
        self._claim_seen.clear()
        return claimed


@dataclass(frozen=True)
class ObjectStoreLocation:
    ledger: ray.actor.ActorHandle


class ObjectStoreSender(StagingSender):
    connector = "object_store"

    def __init__(self, config: TransferConfig, block_size: int, device: torch.device | None = None):
        """``device`` is the encoder's, unused: payloads are staged in Ray's object store."""
        if not ray.is_initialized():
            raise RuntimeError(
                "the object_store connector runs inside Ray: call ray.init() or run under Serve"
            )
        super().__init__(config, block_size, sender_id=f"object-store-sender-{uuid.uuid4().hex[:12]}")
        self.ledger = StagingLedger.remote()
        self._location = ObjectStoreLocation(self.ledger)
        self._start_service()

    def _write(self, entry: StagedEntry, staged: torch.Tensor) -> ObjectStoreLocation:
        # As raw bytes: numpy arrays are read back zero-copy from shared memory, and bytes carry any
        # dtype (numpy has no bfloat16).
        payload_bytes = staged.contiguous().cpu().view(torch.uint8).numpy()
        ref = ray.put(payload_bytes)
        # Wait for the ledger to hold it: the handle must not reach a receiver before its entry.
        ray.get(self.ledger.add.remote(entry.token, [ref]))
        return self._location

    def _discard(self, entry: StagedEntry, pulled: bool) -> None:
        if not pulled:
            # Waited for: once release() or expiry returns, no claim may succeed.
            ray.get(self.ledger.drop.remote(entry.token))

    def _wait_pulled(self, timeout_s: float) -> list[int]:
        return ray.get(self.ledger.wait_claimed.remote(_CLAIM_POLL_S), timeout=_CLAIM_POLL_S + 30)

    def close(self) -> None:
        if self._closed.is_set():
            return
        super().close()
        ray.kill(self.ledger)


class ObjectStoreReceiver(KVReceiver):
    connector = "object_store"

    def __init__(self, config: TransferConfig, device: torch.device):
        self.config = config
        self.device = torch.device(device)

    def pull_blocks(self, handle: TransferHandle, storage: PagedKVStorage, block_ids: list[int]) -> None:
        self.check_connector(handle)
        try:
            handle.layout.check_fits(storage, block_ids)
        except IncompatibleHandleError:
            # Claimed, not dropped: a claim is what tells the sender to free the staging now (a drop
            # leaves it held until unclaimed_timeout_s). The payload itself is never fetched.
            handle.location.ledger.claim.remote(handle.staging_token)
            raise
        storage.write_blocks(block_ids, self._fetch(handle))

    def pull_states(self, handle: TransferHandle) -> torch.Tensor:
        self.check_connector(handle)
        # A copy: the fetched tensor is a view of shared memory that goes with the object.
        return self._fetch(handle).to(self.device, copy=True)

    def discard(self, handle: TransferHandle) -> None:
        try:
            handle.location.ledger.claim.remote(handle.staging_token)  # a claim frees it; no fetch
        except Exception:
            logger.debug("discarding %s failed", handle.request_id, exc_info=True)  # the sender is gone

    def _fetch(self, handle: TransferHandle) -> torch.Tensor:
        deadline = time.monotonic() + self.config.pull_timeout_s
        try:
            claimed = ray.get(
                handle.location.ledger.claim.remote(handle.staging_token), timeout=self.config.pull_timeout_s
            )
            if claimed is None:
                raise TransferError(
                    f"staging for {handle.request_id} was released before the pull "
                    "(unclaimed_timeout_s or released)"
                )
            payload_bytes: np.ndarray = ray.get(claimed[0], timeout=max(deadline - time.monotonic(), 0.001))
        except TransferError:
            raise
        except Exception as error:  # the sender died (actor, owner), the object was lost, or a timeout
            raise TransferError(
                f"pulling {handle.request_id} from {handle.sender_id} failed: {error!r}"
            ) from error
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only shared memory; it is only read
            payload = torch.from_numpy(payload_bytes)
        return payload.view(handle.layout.torch_dtype).view(handle.layout.staged_shape)
