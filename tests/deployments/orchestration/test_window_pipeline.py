"""The ingress's window pipeline when its caller goes away between the encoder and the decoder: the
window's staged K/V is freed at once, not after transfer.unclaimed_timeout_s. The encoder and the
decoder are stand-ins for their deployments' handles (a Serve handle's method: ``.remote(...)``
gives an awaitable); the staging, the transfer handle and its discard are the real local
connector's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from deployments.orchestration.pipeline import WindowPipeline
from engine.types import DecodeOptions, Priority
from kv_transfer import make_receiver, make_sender
from kv_transfer.config import TransferConfig

TINY_EN_CROSS_KV = (4, 2, 1500, 6, 64)


class Method:
    """What the pipeline calls on a deployment handle: ``method.remote(*args)`` -> an awaitable."""

    def __init__(self, function):
        self.function = function

    def remote(self, *args):
        return asyncio.ensure_future(self.function(*args))


class StagingEncoder:
    """Stages each window's (random) cross-attention K/V with a real sender, as the encoder does."""

    def __init__(self, sender):
        self.sender = sender
        self.encode = Method(self._encode)

    async def _encode(self, job):
        return self.sender.stage(job.request_id, torch.randn(TINY_EN_CROSS_KV), "cross_kv")


class QueuedDecoder:
    """A decoder whose decode calls wait in Serve's queue and never reach a replica; its discard is
    a real receiver's."""

    def __init__(self, receiver):
        self.receiver = receiver
        self.queued = asyncio.Event()
        self.decode = Method(self._decode)
        self.discard = Method(self._discard)

    async def _decode(self, *args):
        self.queued.set()
        await asyncio.Event().wait()

    async def _discard(self, handle):
        self.receiver.discard(handle)


def test_a_window_cancelled_after_encoding_and_before_a_decoder_took_it_frees_its_staging_at_once():
    config = TransferConfig(connector="local", staging_memory_mb=64, unclaimed_timeout_s=120)
    sender = make_sender(config, block_size=128)
    decoder = None

    async def scenario() -> None:
        nonlocal decoder
        decoder = QueuedDecoder(make_receiver(config))
        pipeline = WindowPipeline(StagingEncoder(sender), decoder, max_windows_in_flight=1)
        samples = np.zeros(16000, dtype=np.float32)
        window = asyncio.ensure_future(
            pipeline.decode_window("w", samples, DecodeOptions(), Priority.INTERACTIVE)
        )
        await asyncio.wait_for(decoder.queued.wait(), 10)
        assert sender.num_staged == 1  # encoded and staged; no decoder has it
        window.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await window
        for _ in range(100):
            if sender.num_staged == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert sender.num_staged == 0, "the staged K/V waits for unclaimed_timeout_s (120 s)"
