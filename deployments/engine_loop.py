"""EngineLoop: a DecoderEngine's continuous-batching loop on a thread of its own, awaited from an
event loop.

A window arrives on the event loop as a request; the loop thread admits it at its next step (pulling
its cross-attention K/V, or projecting its encoder states, into freshly allocated blocks) and hands
its result back to the waiting coroutine. A caller that goes away (client disconnect, timeout)
cancels its coroutine, which aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from engine import CrossKVSource, DecoderEngine, EngineStats
from engine.types import DecodeOptions, DecodeResult, FinishReason, Priority

logger = logging.getLogger("ray.serve")


class EngineLoop:
    def __init__(self, engine: DecoderEngine):
        self.engine = engine
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._waiters_lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = False
        self.windows_decoded = 0
        self.windows_aborted = 0  # callers that went away (disconnects, timeouts) before their result
        self.tokens_generated = 0
        self.loop_busy_s = 0.0  # time the loop thread spent inside engine steps, since start
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)

    def start(self) -> None:
        """Starts the loop thread, once whatever shares the process is built."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check_options(self, options: DecodeOptions) -> None:
        """Raise RequestRejectedError if the engine cannot decode with ``options``."""
        self.engine.make_request(options, cross_source=None)

    def occupancy(self) -> float:
        """Running and waiting windows over ``max_num_seqs``."""
        stats = self.engine.stats()
        return (stats.num_running + stats.num_waiting) / self.engine.scheduler.max_num_seqs

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def decode(
        self,
        source: CrossKVSource,
        request_id: str,
        options: DecodeOptions,
        audio_duration_s: float | None,
        priority: Priority,
    ) -> DecodeResult:
        request = self.engine.make_request(
            options, source, request_id=request_id, audio_duration_s=audio_duration_s, priority=priority
        )
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._waiters_lock:
            self._waiters[request.request_id] = (loop, future)
        self.engine.submit(request)
        self._work.set()
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.abort(request.request_id)
            self._work.set()
            raise
        finally:
            with self._waiters_lock:
                self._waiters.pop(request.request_id, None)

    def close(self) -> None:
        """Ends the loop after its current step; the engine closes with it."""
        self._stopping = True
        self._work.set()

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work:
                self._work.wait(timeout=0.5)
                self._work.clear()
                continue
            started = time.perf_counter()
            try:
                results = self.engine.step()
            except Exception:
                # A bug in one step must not kill the loop silently: fail every waiter loudly,
                # so no request hangs, and keep serving the next ones.
                logger.exception("decoder step failed")
                self._fail_all("the decoder step failed; see the replica log")
                continue
            finally:
                self.loop_busy_s += time.perf_counter() - started
            for result in results:
                if result.finish_reason == FinishReason.ABORTED:
                    self.windows_aborted += 1
                else:
                    self.windows_decoded += 1
                self.tokens_generated += len(result.tokens)
                self._deliver(result)
        self.engine.close()

    def _deliver(self, result: DecodeResult) -> None:
        with self._waiters_lock:
            waiter = self._waiters.get(result.request_id)
        if waiter is None:
            return  # the caller went away and aborted; nothing waits for this result
        loop, future = waiter
        loop.call_soon_threadsafe(_resolve, future, result)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self.engine.request_ids()):
            self.engine.abort(request_id)
        with self._waiters_lock:
            waiters = list(self._waiters.values())
        for loop, future in waiters:
            loop.call_soon_threadsafe(_fail, future, RuntimeError(message))


def _resolve(future: asyncio.Future, result: DecodeResult) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
