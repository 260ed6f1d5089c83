"""Same-process connector: encoder and decoder in one replica. Staging is a device tensor and a
pull is one device copy into the cache's blocks; nothing is serialized.

Within one process torch's copy is the fast path: two NIXL agents in the same process cannot use
CUDA IPC, and UCX falls back to TCP loopback, far slower than a device copy.
"""

from __future__ import annotations

import threading
import uuid
import weakref

import torch

from engine.kv.storage import PagedKVStorage
from kv_transfer.base import KVReceiver, TransferError, TransferHandle
from kv_transfer.config import TransferConfig
from kv_transfer.staging import StagedEntry, StagingBuffer, StagingSender

# Receivers find their sender by id; a sender that was closed or collected is gone.
_senders: weakref.WeakValueDictionary[str, "LocalSender"] = weakref.WeakValueDictionary()
_senders_lock = threading.Lock()


class LocalSender(StagingSender):
    connector = "local"
    header_bytes = StagingBuffer.header_bytes

    def __init__(self, config: TransferConfig, block_size: int, device: torch.device):
        super().__init__(config, block_size, sender_id=f"local-sender-{uuid.uuid4().hex[:12]}")
        self.buffer = StagingBuffer(self.arena.capacity_bytes, torch.device(device))
        with _senders_lock:
            _senders[self.sender_id] = self
        self._start_service()

    def _write(self, entry: StagedEntry, staged: torch.Tensor) -> None:
        self.buffer.write(entry, staged)
        return None  # the staging token is the whole address

    def _discard(self, entry: StagedEntry, pulled: bool) -> None:
        self.buffer.clear(entry)

    def claim(self, token: int) -> StagedEntry | None:
        """Take an entry for a receiver's copy; None when it was released, expired or claimed."""
        return self._claim(token)

    def finish(self, entry: StagedEntry) -> None:
        self._free(entry.token, pulled=True)

    def close(self) -> None:
        with _senders_lock:
            _senders.pop(self.sender_id, None)
        super().close()


class LocalReceiver(KVReceiver):
    connector = "local"

    def __init__(self, config: TransferConfig, device: torch.device):
        self.config = config
        self.device = torch.device(device)

    def pull_blocks(self, handle: TransferHandle, storage: PagedKVStorage, block_ids: list[int]) -> None:
        self.check_connector(handle)
        sender, entry = self._claim(handle)
        try:
            handle.layout.check_fits(storage, block_ids)
            storage.write_blocks(block_ids, sender.buffer.payload(entry))
        finally:
            sender.finish(entry)

    def pull_states(self, handle: TransferHandle) -> torch.Tensor:
        self.check_connector(handle)
        sender, entry = self._claim(handle)
        try:
            return sender.buffer.payload(entry).to(self.device, copy=True)
        finally:
            sender.finish(entry)

    def discard(self, handle: TransferHandle) -> None:
        try:
            sender, entry = self._claim(handle)
        except TransferError:
            return  # released already, or the sender is gone
        sender.finish(entry)

    def _claim(self, handle: TransferHandle) -> tuple[LocalSender, StagedEntry]:
        with _senders_lock:
            sender = _senders.get(handle.sender_id)
        if sender is None:
            raise TransferError(f"the sender of {handle.request_id} ({handle.sender_id}) is gone")
        entry = sender.claim(handle.staging_token)
        if entry is None:
            raise TransferError(
                f"staging for {handle.request_id} was released before the pull "
                "(unclaimed_timeout_s or released)"
            )
        return sender, entry
