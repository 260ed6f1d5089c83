"""The ingress's window pipeline when its caller goes away between the encoder and the decoder: the
window's staged K/V is freed at once, not after transfer.unclaimed_timeout_s; and when the model
fails a window in a way trying again would not cure: one answer that says what happened. The encoder and the
decoder are stand-ins for their deployments' handles (a Serve handle's method: ``.remote(...)``
gives an awaitable); the staging, the transfer handle and its discard are the real local
connector's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from deployments.http.errors import api_error_of
from deployments.orchestration.pipeline import WindowPipeline
from engine.decode.scheduler import NON_FINITE_LOGITS
from engine.errors import WindowFailedError
from engine.types import DecodeOptions, DecodeResult, FinishReason, Priority
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


class OverflowingDecoder:
    """A colocated decoder (it encodes its own windows) whose model overflows on every window."""

    def __init__(self):
        self.calls = 0
        self.transcribe_window = Method(self._transcribe_window)

    async def _transcribe_window(self, job, *args):
        self.calls += 1
        return DecodeResult(
            job.request_id, [], "", 0.0, 0.0, None, 0.0, FinishReason.ERROR, error=NON_FINITE_LOGITS
        )


def test_a_window_the_model_overflows_on_fails_once_with_a_500_that_says_what_happened(caplog):
    decoder = OverflowingDecoder()
    pipeline = WindowPipeline(None, decoder, max_windows_in_flight=1)
    samples = np.zeros(16000, dtype=np.float32)
    with pytest.raises(WindowFailedError) as failed:
        asyncio.run(pipeline.decode_window("w", samples, DecodeOptions(), Priority.INTERACTIVE))
    assert decoder.calls == 1, "an overflow is not a transient failure: no attempt again"
    error = api_error_of(failed.value)
    assert error.status == 500 and error.code == "window_failed"
    assert error.message == f"Transcription failed: {NON_FINITE_LOGITS}."
    # One line for the operator, with the window it happened on; no traceback.
    assert [record.getMessage() for record in caplog.records if record.levelname == "ERROR"] == [
        f"window w failed: {NON_FINITE_LOGITS}"
    ]
    assert not any(record.exc_info for record in caplog.records)
