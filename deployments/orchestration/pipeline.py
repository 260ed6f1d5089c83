"""A request's windows through the encoder and decoder deployments: the windows its long-form
cursor (engine/transcribe/windows.py) hands out, a sliding window of them in flight, and a window
whose replica is lost or whose K/V transfer failed sent through the encoder again. Colocated
(``placement: colocated``), a window is one call to a replica that encodes and decodes it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.engine_process import EngineProcessExited
from deployments.window_batcher import WindowJob
from engine import SAMPLE_RATE, LongFormCursor, PendingWindow, Transcription
from engine.errors import RetriableError, WindowFailedError
from engine.types import DecodeOptions, DecodeResult, FinishReason, Priority
from kv_transfer.base import TransferHandle

logger = logging.getLogger("ray.serve")

# What a replica that died or is restarting looks like to its caller (a replica whose engine process
# died answers EngineProcessExited until Serve's health check replaces it).
REPLICA_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, EngineProcessExited)

# A window is tried this many times (encoded again each time) before the request fails with 503.
WINDOW_ATTEMPTS = 3


class WindowPipeline:
    def __init__(
        self, encoder: DeploymentHandle | None, decoder: DeploymentHandle, max_windows_in_flight: int
    ):
        """``encoder`` None: the decoder replicas encode their own windows (colocated)."""
        self.encoder = encoder
        self.decoder = decoder
        self.max_windows_in_flight = max_windows_in_flight
        self._discards: set[asyncio.Future] = set()  # discard calls under way (kept from the GC)

    async def transcribe(self, cursor: LongFormCursor, priority: Priority) -> Transcription:
        async for _ in self.decoded(cursor, priority):
            pass
        return cursor.transcription()

    async def decoded(self, cursor: LongFormCursor, priority: Priority) -> AsyncIterator[DecodeResult]:
        """Each window's result as it enters the transcript, in order, as soon as it and those
        before it are decoded. Up to ``max_windows_in_flight`` of the windows the cursor has handed
        out are in flight at once, so they share encoder batches and decoder steps (a sequential
        cursor hands out one at a time, each prompted by the text before it)."""
        request_id = uuid.uuid4().hex
        handed_out: deque[PendingWindow] = deque()
        in_flight: deque[tuple[PendingWindow, asyncio.Future]] = deque()

        def start_windows() -> None:
            handed_out.extend(cursor.next_windows())
            while handed_out and len(in_flight) < self.max_windows_in_flight:
                pending = handed_out.popleft()
                decoding = self.decode_window(
                    f"{request_id}-{pending.index}", pending.window.samples, pending.options, priority
                )
                in_flight.append((pending, asyncio.ensure_future(decoding)))

        start_windows()
        try:
            while in_flight:
                pending, decoding = in_flight.popleft()
                result = cursor.accept(pending.window, await decoding)
                start_windows()  # a sliding window: memory stays flat however long the file
                yield result
        finally:
            for _, decoding in in_flight:
                decoding.cancel()  # a failed window or a client gone: stop decoding the others

    async def decode_window(
        self,
        window_id: str,
        samples,
        options: DecodeOptions,
        priority: Priority,
        encoder_frames: int | None = None,
    ) -> DecodeResult:
        """Encode (over ``encoder_frames``, None: the full window) and decode one window. A lost
        replica (killed, crashed, restarting) or a failed K/V transfer sends the window through the
        encoder again, to whichever replicas Serve routes it to now; only when every attempt fails
        does the request get a 503."""
        failure = "no attempt made"
        duration_s = len(samples) / SAMPLE_RATE
        for attempt in range(WINDOW_ATTEMPTS):
            try:
                job = WindowJob(f"{window_id}-a{attempt}", samples, priority, encoder_frames)
                if self.encoder is None:
                    result = await self.decoder.transcribe_window.remote(job, options, duration_s, priority)
                else:
                    handle = await self.encoder.encode.remote(job)
                    result = await self._decode(handle, options, duration_s, priority)
            except REPLICA_LOST as error:
                failure = f"a replica was lost ({type(error).__name__})"
                logger.warning("window %s: %s; trying again (attempt %d)", window_id, failure, attempt + 1)
                continue
            if result.finish_reason != FinishReason.ERROR:
                return result
            if not result.retriable:
                # The server's failure, said in one line for the operator (a traceback would only
                # show this call) and in words to the client.
                logger.error("window %s failed: %s", window_id, result.error)
                raise WindowFailedError(result.error)
            failure = result.error or "cross-attention K/V transfer failed"
            logger.warning("window %s: %s; encoding again (attempt %d)", window_id, failure, attempt + 1)
        raise RetriableError(f"window {window_id} failed {WINDOW_ATTEMPTS} times; last: {failure}")

    async def _decode(
        self, handle: TransferHandle, options: DecodeOptions, duration_s: float, priority: Priority
    ) -> DecodeResult:
        try:
            return await self.decoder.decode.remote(handle, options, duration_s, priority)
        except asyncio.CancelledError:
            # The caller went away (a client gone, a failed window beside it). If the decode call
            # was still queued, no decoder holds the handle and the staged K/V would wait for
            # transfer.unclaimed_timeout_s: free it now. A decoder that took it releases it once
            # anyway (an abort before its pull discards it, a pull releases it), so this is harmless.
            discarding = asyncio.ensure_future(self._discard(handle))
            self._discards.add(discarding)
            discarding.add_done_callback(self._discards.discard)
            raise

    async def _discard(self, handle: TransferHandle) -> None:
        try:
            await self.decoder.discard.remote(handle)
        except Exception:
            logger.debug("discarding the staged K/V of %s failed", handle.request_id, exc_info=True)
