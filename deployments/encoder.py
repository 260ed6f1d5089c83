"""EncoderDeployment: batches 30 s windows from many requests into one encoder forward, then
stages each window's cross-attention K/V (or encoder states) with the transfer layer.

Windows wait in a queue inside the replica where interactive ones go first (Serve's own
``serve.batch`` is first come, first served); batch windows fill the room interactive ones leave in
a forward, since a window that waits for a later forward holds its request back and spends the GPU
on one more small batch.

How long a forward waits to fill follows the decoders: encoder and decoder replicas may share a GPU
(two processes, so CUDA stream priorities cannot order them, and MPS is not something a replica can
turn on), and there an encoder forward's cost per window falls steeply with its size. While the
emptiest decoder replica is busy (``encoder.decoder_busy_occupancy``), a new window would join a
decode batch of many and wait there anyway, so the forward waits up to ``busy_batch_wait_ms`` for
more windows; while the decoders have room, ``batch_wait_timeout_ms`` keeps short requests fast.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import PENDING_WINDOWS
from deployments.config import AppConfig
from engine.encode.runner import EncoderRunner
from engine.model.audio import pad_or_trim
from engine.model.loading import load_model
from engine.types import Priority, is_promoted
from kv_transfer import make_sender
from kv_transfer.base import TransferHandle

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class WindowJob:
    """One window to encode: what crosses from the ingress to the encoder."""

    request_id: str  # unique per window; the transfer handle carries it to the decoder
    samples: np.ndarray  # float32, 16 kHz mono, at most 30 s
    priority: Priority = Priority.INTERACTIVE


@dataclass(eq=False)  # compared by identity: the queue removes exactly this window
class QueuedWindow:
    job: WindowJob
    done: asyncio.Future  # the staged handle, or the exception that failed this window
    arrived_s: float  # time.monotonic()


@dataclass(frozen=True)
class EncoderStats:
    windows_encoded: int
    batches: int
    last_batch_size: int
    mean_batch_size: float
    num_staged: int
    num_pending: int  # windows queued or in the forward now
    node_id: str  # the Ray node the replica runs on (placement by resources is checked with it)
    connector: str  # the transfer connector really in use ("nixl", "object_store", "local")
    payload: str  # what is shipped: "cross_kv" or "encoder_states"
    precision: str  # the encoder's precision path, e.g. "bfloat16 on CPU" (EngineConfig.encoder_precision)
    # Sums since start, for where a window's time goes (/metrics; benchmarks/bench_load.py):
    queued_s: float = 0.0  # each window's wait in the queue, from arrival to its forward's start
    window_forward_s: float = 0.0  # each window's forward (its batch's encode and staging time)
    busy_s: float = 0.0  # forwards' time: how much of the replica's time it encodes


class EncoderDeployment:
    def __init__(self, config: AppConfig, decoder: DeploymentHandle | None = None):
        if config.encoder.torch_threads:
            torch.set_num_threads(config.encoder.torch_threads)
        self.config = config
        started = time.perf_counter()
        self.loaded = load_model(config.engine)
        loaded_s = time.perf_counter() - started
        # Decoding happens in the decoder replicas: of the decoder keep only what makes a window's
        # cross-attention K/V, and hand the rest back (a GPU may be shared with a decoder replica).
        self.loaded.model.decoder.keep_only_cross_kv()
        if config.engine.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        self.runner = EncoderRunner(self.loaded)  # compiles and warms the encoder where it is compiled
        logger.info(
            "encoder replica prepared in %.1f s: %s loaded in %.1f s, encoder (%s, compiled: %s) "
            "ready in %.1f s",
            time.perf_counter() - started,
            config.engine.model,
            loaded_s,
            config.engine.encoder_precision,
            config.engine.gpu_switches().compile_encoder,
            time.perf_counter() - started - loaded_s,
        )
        self.payload = config.transfer.resolved_mode()
        self.sender = make_sender(
            config.transfer, block_size=config.engine.block_size, device=config.engine.torch_device
        )
        logger.info("encoder: %s transfer, shipping %s", config.transfer.resolved_connector(), self.payload)
        self.windows_encoded = 0
        self.batches = 0
        self.last_batch_size = 0
        self.queued_s = self.window_forward_s = self.busy_s = 0.0
        self._queue: list[QueuedWindow] = []  # in arrival order
        self._in_forward = 0
        self._window_arrived: asyncio.Event | None = None  # made on the replica's event loop, at first use
        self._batch_loop: asyncio.Task | None = None
        self._decoder = decoder  # read for its load only; windows reach it through the ingress
        self._decoder_occupancy = 0.0  # as last read; 0 (room) until read, or when the read fails
        self._load_watch: asyncio.Task | None = None

    async def encode(self, job: WindowJob) -> TransferHandle:
        """Encode one window (batched with others waiting meanwhile) and stage its payload."""
        if self._batch_loop is None:
            self._window_arrived = asyncio.Event()
            self._batch_loop = asyncio.create_task(self._run_batches())
            if self._decoder is not None:
                self._load_watch = asyncio.create_task(self._watch_decoder_load())
        window = QueuedWindow(job, asyncio.get_running_loop().create_future(), time.monotonic())
        self._queue.append(window)
        self._window_arrived.set()
        try:
            return await window.done
        finally:
            if window in self._queue:  # the caller went away before its forward: drop the window
                self._queue.remove(window)

    async def _run_batches(self) -> None:
        max_batch_size = self.config.encoder.max_batch_size
        while True:
            await self._window_arrived.wait()
            self._window_arrived.clear()
            await self._let_batch_fill(max_batch_size)
            while self._queue:
                batch = self._next_batch(max_batch_size)
                self._in_forward = len(batch)
                started = time.monotonic()
                self.queued_s += sum(started - window.arrived_s for window in batch)
                try:
                    # In a worker thread, so this replica's event loop keeps answering health checks
                    # and queueing windows while the encoder computes.
                    outcomes = await asyncio.to_thread(self._encode_and_stage, [w.job for w in batch])
                except Exception as error:  # the forward failed: every window of it fails, loudly
                    logger.exception("encoder forward failed")
                    outcomes = [error] * len(batch)
                finally:
                    self._in_forward = 0
                    forward_s = time.monotonic() - started
                    self.busy_s += forward_s
                    self.window_forward_s += forward_s * len(batch)
                for window, outcome in zip(batch, outcomes):
                    if window.done.cancelled() and isinstance(outcome, TransferHandle):
                        # Its caller went away during the forward (a client that hung up): no
                        # decoder will pull this; free it now rather than when the unclaimed
                        # timeout expires.
                        self.sender.release(outcome.request_id)
                        continue
                    if window.done.done():
                        continue
                    if isinstance(outcome, Exception):
                        window.done.set_exception(outcome)
                    else:
                        window.done.set_result(outcome)

    @property
    def decoders_busy(self) -> bool:
        return self._decoder_occupancy >= self.config.encoder.decoder_busy_occupancy

    async def _let_batch_fill(self, max_batch_size: int) -> None:
        """Wait until the queue holds a full batch or the fill time (set by the decoders' load) passes."""
        encoder = self.config.encoder
        wait_ms = encoder.busy_batch_wait_ms if self.decoders_busy else encoder.batch_wait_timeout_ms
        deadline = time.monotonic() + wait_ms / 1000
        while len(self._queue) < max_batch_size and (left_s := deadline - time.monotonic()) > 0:
            self._window_arrived.clear()
            try:
                await asyncio.wait_for(self._window_arrived.wait(), timeout=left_s)
            except asyncio.TimeoutError:
                break

    async def _watch_decoder_load(self) -> None:
        while True:
            try:
                self._decoder_occupancy = await self._decoder.occupancy.remote()
            except Exception:  # a decoder replica restarting: assume room, so no window waits for it
                logger.debug("could not read the decoders' load", exc_info=True)
                self._decoder_occupancy = 0.0
            await asyncio.sleep(self.config.encoder.decoder_load_poll_ms / 1000)

    def _next_batch(self, max_batch_size: int) -> list[QueuedWindow]:
        """The oldest interactive (or aged batch) windows waiting, then the oldest batch ones."""
        now = time.monotonic()
        aging_s = self.config.engine.batch_aging_s

        def rank(window: QueuedWindow) -> int:
            return 0 if is_promoted(window.job.priority, now - window.arrived_s, aging_s) else 1

        batch = sorted(self._queue, key=rank)[:max_batch_size]  # a stable sort: arrival order in a rank
        for window in batch:
            self._queue.remove(window)
        return batch

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; deployments/autoscaling.py reads it."""
        return {PENDING_WINDOWS: self.num_pending}

    @property
    def num_pending(self) -> int:
        """Windows queued or in the forward now."""
        return len(self._queue) + self._in_forward

    def _encode_and_stage(self, jobs: list[WindowJob]) -> list[TransferHandle | Exception]:
        started = time.perf_counter()
        audio = torch.from_numpy(np.stack([pad_or_trim(job.samples) for job in jobs]))
        states = self.runner.encode(audio)
        payloads = self.runner.cross_kv(states) if self.payload == "cross_kv" else states
        handles: list[TransferHandle | Exception] = []
        for job, payload in zip(jobs, payloads):
            try:
                handles.append(self.sender.stage(job.request_id, payload, self.payload))
            except Exception as error:  # back-pressure or a transport error fails this window only
                handles.append(error)
        self.windows_encoded += len(jobs)
        self.batches += 1
        self.last_batch_size = len(jobs)
        logger.debug("encoded %d windows in %.3f s", len(jobs), time.perf_counter() - started)
        return handles

    def stats(self) -> EncoderStats:
        return EncoderStats(
            windows_encoded=self.windows_encoded,
            batches=self.batches,
            last_batch_size=self.last_batch_size,
            mean_batch_size=self.windows_encoded / self.batches if self.batches else 0.0,
            num_staged=self.sender.num_staged,
            num_pending=self.num_pending,
            node_id=ray.get_runtime_context().get_node_id(),
            connector=self.config.transfer.resolved_connector(),
            payload=self.payload,
            precision=self.config.engine.encoder_precision,
            queued_s=self.queued_s,
            window_forward_s=self.window_forward_s,
            busy_s=self.busy_s,
        )

    async def __del__(self):
        """Serve calls this on scale-down after the replica's encode calls have finished. Decoders
        may not have pulled the last windows' K/V yet: wait for them (up to drain_timeout_s), so
        scaling down never sends a window back through the encoder."""
        sender = getattr(self, "sender", None)
        if sender is None:
            return
        deadline = time.monotonic() + self.config.encoder.drain_timeout_s
        while sender.num_staged and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        sender.close()
