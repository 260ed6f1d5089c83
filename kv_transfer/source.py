"""The decoder engine's view of a transfer: a CrossKVSource that pulls at admission time."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.sources import StateProjection
from engine.kv.storage import PagedKVStorage
from kv_transfer.base import KVReceiver, TransferHandle


@dataclass
class TransferredCrossKV:
    """Loads a request's cross-attention K/V from a handle when the scheduler admits it, so the
    blocks it lands in are the ones just allocated; in the encoder_states mode the decoder
    projects the states itself. Errors propagate as TransferError and fail only this request."""

    handle: TransferHandle
    receiver: KVReceiver
    travels = True  # a pull: it loads beside the decode loop

    @property
    def num_frames(self) -> int:
        return self.handle.layout.num_frames

    def discard(self) -> None:
        self.receiver.discard(self.handle)

    def load_into(
        self, storage: PagedKVStorage, block_ids: list[int], project_states: StateProjection
    ) -> None:
        if self.handle.layout.payload == "cross_kv":
            self.receiver.pull_blocks(self.handle, storage, block_ids)
        else:
            storage.write_sequence(block_ids, project_states(self.receiver.pull_states(self.handle)))
