"""Moving each request's cross-attention K/V (or encoder states) from an encoder replica into a
decoder replica's paged cache. ``make_sender`` / ``make_receiver`` turn a TransferConfig into the
configured connector's two halves; kv_transfer/README.md says which to pick."""

from __future__ import annotations

import torch

from engine.kv.storage import PagedKVStorage
from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransferConfig


def sender_class(config: TransferConfig) -> type[KVSender]:
    """The configured connector's sender, not yet made (what a payload takes in its staging)."""
    connector = config.resolved_connector()
    if connector == "nixl":
        from kv_transfer.nixl import NixlSender

        return NixlSender
    if connector == "object_store":
        from kv_transfer.object_store import ObjectStoreSender

        return ObjectStoreSender
    from kv_transfer.local import LocalSender

    return LocalSender


def make_sender(config: TransferConfig, *, block_size: int, device: torch.device | str = "cpu") -> KVSender:
    """The encoder side. ``block_size`` is the decoders' (engine.block_size): staging is cut into
    exactly their cache blocks, so each block moves as one region."""
    return sender_class(config)(config, block_size, torch.device(device))


def make_receiver(
    config: TransferConfig, *, storage: PagedKVStorage | None = None, device: torch.device | str | None = None
) -> KVReceiver:
    """The decoder side. Pass the engine's ``storage``: NIXL registers its cache tensor once, up front."""
    connector = config.resolved_connector()
    device = storage.cache.device if storage is not None else torch.device(device or "cpu")
    if connector == "nixl":
        from kv_transfer.nixl import NixlReceiver

        return NixlReceiver(config, storage=storage, device=device)
    if connector == "object_store":
        from kv_transfer.object_store import ObjectStoreReceiver

        return ObjectStoreReceiver(config, device)
    from kv_transfer.local import LocalReceiver

    return LocalReceiver(config, device)
