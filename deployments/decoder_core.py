"""DecoderCore: what a decoder replica runs: one DecoderEngine and its continuous-batching loop in
a thread, in the engine's process (deployments/engine_process.py; deployments/decoder.py is the
replica that forwards Serve's calls to it).

Requests arrive on the core's event loop with a transfer handle; the loop thread admits them
at its next step (pulling their cross-attention K/V into freshly allocated blocks) and hands each
finished result back to the waiting coroutine. A caller that goes away (client disconnect,
timeout) cancels its coroutine, which aborts the request and frees its blocks.

Colocated (``placement: colocated``), the core also encodes: windows arrive as audio, are
batched (deployments/window_batcher.py) and encoded on a CUDA stream of their own beside the decode
loop's, and their encoder states go to the engine in process, which projects them into
cross-attention K/V at admission. On one GPU that is the difference between kernels that run side
by side (two streams of one process) and kernels that take turns (two processes without MPS), and
nothing travels. A forward starts only while few encoded windows wait for admission, so encoded
states never pile up in GPU memory; the audio waits instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from deployments.autoscaling import INTERACTIVE_WAITING, KV_DEMAND_BLOCKS, KV_TOTAL_BLOCKS
from deployments.config import AppConfig
from deployments.encoder import EncoderStats
from deployments.routing import KVRoutingStats
from deployments.window_batcher import WindowBatcher, WindowJob
from engine.decode.engine import DecoderEngine
from engine.decode.heap import freeze_start_up_objects
from engine.decode.timings import LoopTimings
from engine.encode.overlap import OverlappedEncoder
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVSource, EncoderStates
from engine.model.loading import load_model
from engine.types import DecodeOptions, DecodeResult, FinishReason, Priority
from kv_transfer import make_receiver
from kv_transfer.base import TransferHandle
from kv_transfer.source import TransferredCrossKV

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class DecoderStats:
    """KV usage and queue depth: for /metrics, routing and autoscaling."""

    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    windows_decoded: int
    windows_aborted: int  # callers that went away (disconnects, timeouts) before their result
    tokens_generated: int
    node_id: str  # the Ray node the replica runs on (placement by resources is checked with it)
    kv_loads: int = 0  # cross-attention K/V pulls landed
    kv_load_p50_s: float = float("nan")  # of the recent pulls, from start to landing
    kv_load_p95_s: float = float("nan")
    timings: LoopTimings = field(default_factory=LoopTimings)  # the engine's step and window sums
    loop_busy_s: float = 0.0  # time the loop thread spent inside engine steps, since start


class DecoderCore:
    def __init__(self, config: AppConfig, node_id: str):
        if config.decoder.torch_threads:
            torch.set_num_threads(config.decoder.torch_threads)
        started = time.perf_counter()
        self.config = config
        self.loaded = load_model(config.engine)
        loaded_s = time.perf_counter() - started
        if not config.colocated:
            # Encoding happens in the encoder replicas: free the encoder's weights here (for
            # large-v3, 1.3 GB of GPU memory this replica would hold and never use).
            self.loaded.model.encoder = None
            if config.engine.torch_device.type == "cuda":
                torch.cuda.empty_cache()  # back to the GPU, which an encoder replica may share
        self.engine = DecoderEngine(self.loaded)  # sizes the KV cache, captures decode CUDA graphs
        self.receiver = (
            None if config.colocated else make_receiver(config.transfer, storage=self.engine.storage)
        )
        self.encoder: OverlappedEncoder | None = None
        self.batcher: WindowBatcher | None = None
        if config.colocated:
            # Compiles and warms the encoder where it is compiled.
            self.encoder = OverlappedEncoder(
                EncoderRunner(self.loaded, graph_batch_size=config.encoder.max_batch_size),
                project_cross_kv=False,
            )
            self.batcher = WindowBatcher(
                self._encode_windows,
                config.encoder.max_batch_size,
                config.engine.batch_aging_s,
                fill_wait_ms=lambda: config.encoder.fill_wait_ms(self._occupancy()),
                may_start=self._may_encode,
            )
        self.node_id = node_id
        # The replica keeps what it started with for its life: out of the collector's full
        # collections, which would otherwise pause the decode loop (engine/decode/heap.py).
        frozen = freeze_start_up_objects() if config.decoder.freeze_start_up_objects else 0
        self.ready_info = (
            "decoder prepared in %.1f s: %s loaded in %.1f s, engine and %s in %.1f s"
            % (
                time.perf_counter() - started,
                config.engine.model,
                loaded_s,
                f"encoder ({config.engine.encoder_precision})"
                if config.colocated
                else f"{config.transfer.resolved_connector()} receiver",
                time.perf_counter() - started - loaded_s,
            )
            + f"; {frozen} start-up objects frozen"
        )
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._waiters_lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = False
        self.windows_decoded = 0
        self.windows_aborted = 0
        self.tokens_generated = 0
        self.loop_busy_s = 0.0
        self._routing_reports = itertools.count()
        self._loop_thread = threading.Thread(target=self._run_loop, name="decode-loop", daemon=True)
        self._loop_thread.start()

    async def check_options(self, options: DecodeOptions) -> None:
        """Raise RequestRejectedError if this model cannot decode with ``options`` (checked before
        any window is encoded, so a bad request costs no encoder work)."""
        self.engine.make_request(options, cross_source=None)

    async def occupancy(self) -> float:
        """Running and waiting windows over ``max_num_seqs``: at or above the encoder's
        ``decoder_busy_occupancy`` it waits for fuller batches."""
        return self._occupancy()

    def _occupancy(self) -> float:
        stats = self.engine.stats()
        return (stats.num_running + stats.num_waiting) / self.engine.scheduler.max_num_seqs

    async def discard(self, handle: TransferHandle) -> None:
        """Free the staged K/V ``handle`` points at, which no decoder will pull (its caller went away
        before a decoder took it); any decoder replica can tell the sender. Best effort."""
        if self.receiver is not None:
            self.receiver.discard(handle)

    async def decode(
        self,
        handle: TransferHandle,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Decode one window whose cross-attention K/V (or states) the handle points at;
        ``audio_duration_s``: how much of the window is audio (word timestamps look only there)."""
        source = TransferredCrossKV(handle, self.receiver)
        return await self._decode(source, handle.request_id, options, audio_duration_s, priority)

    async def transcribe_window(
        self,
        job: WindowJob,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Colocated: encode one window here (batched with others waiting) and decode it."""
        if self.batcher is None:
            raise RuntimeError("transcribe_window is for colocated replicas (placement: colocated)")
        states = await self.batcher.submit(job)
        return await self._decode(EncoderStates(states), job.request_id, options, audio_duration_s, priority)

    def _encode_windows(self, jobs: list[WindowJob]) -> list[torch.Tensor]:
        """A batch's encoder states, one [1500, d] view per window (on a worker thread)."""
        return list(self.encoder.encode_blocking([job.samples for job in jobs]))

    def _may_encode(self) -> bool:
        """Encode more only while fewer than a batch of encoded windows wait for admission."""
        return self.engine.stats().num_waiting < self.config.encoder.max_batch_size

    async def _decode(
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

    def _run_loop(self) -> None:
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

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; deployments/autoscaling.py reads it."""
        stats = self.engine.stats()
        return {
            KV_DEMAND_BLOCKS: stats.num_used_blocks + stats.waiting_blocks,
            KV_TOTAL_BLOCKS: stats.num_total_blocks,
            INTERACTIVE_WAITING: stats.num_waiting_interactive,
        }

    def record_routing_stats(self) -> dict[str, int]:
        """Serve calls this every routing_stats_period_s; deployments/routing.py ranks replicas by it."""
        stats = self.engine.stats()
        return KVRoutingStats(
            report_id=next(self._routing_reports),
            num_total_blocks=stats.num_total_blocks,
            num_free_blocks=stats.num_free_blocks,
            waiting_blocks=stats.waiting_blocks,
            blocks_per_window=self.engine.blocks_per_window,
        ).as_dict()

    def encoder_stats(self) -> EncoderStats:
        """Colocated: the in-process encoder's figures, as an encoder replica reports its own."""
        return EncoderStats.of(
            self.batcher, self.config, 0, "none", "encoder_states", gpu_wait_s=self.encoder.gpu_wait_s
        )

    def stats(self) -> DecoderStats:
        stats = self.engine.stats()
        return DecoderStats(
            num_free_blocks=stats.num_free_blocks,
            num_used_blocks=stats.num_used_blocks,
            num_total_blocks=stats.num_total_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            windows_decoded=self.windows_decoded,
            windows_aborted=self.windows_aborted,
            tokens_generated=self.tokens_generated,
            node_id=self.node_id,
            kv_loads=stats.num_kv_loads,
            kv_load_p50_s=stats.kv_load_p50_s,
            kv_load_p95_s=stats.kv_load_p95_s,
            timings=stats.timings,
            loop_busy_s=self.loop_busy_s,
        )

    def close(self) -> None:
        """Ends the loop. On scale-down Serve stops the replica only after every decode call has
        returned (it is out of the router's set and Serve waits up to decoder.drain_timeout_s)."""
        self._stopping = True
        self._work.set()


def _resolve(future: asyncio.Future, result: DecodeResult) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
