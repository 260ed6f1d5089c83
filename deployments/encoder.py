"""EncoderDeployment: batches 30 s windows from many requests into one encoder forward
(deployments/window_batcher.py; one per encoder context where a live turn's partial passes are
encoded over only their audio), then stages each window's cross-attention K/V (or encoder states)
with the transfer layer.

How long a forward waits to fill follows the decoders: encoder and decoder replicas may share a GPU,
and there an encoder forward's cost per window falls steeply with its size. While the emptiest
decoder replica is busy (``encoder.decoder_busy_occupancy``), a new window would join a decode batch
of many and wait there anyway, so the forward waits up to ``busy_batch_wait_ms`` for more windows;
while the decoders have room, ``batch_wait_timeout_ms`` keeps short requests fast. Two replicas on
one GPU are two processes whose kernels take turns on it (no MPS): ``placement: colocated`` runs
both halves in one process instead (README, "One GPU").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray
import torch
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import PENDING_WINDOWS
from deployments.config import AppConfig, ConfigError
from deployments.window_batcher import WindowBatcher, WindowJob, encode_by_context
from engine import EncoderRunner, ModelDims, load_model
from engine.config import EngineConfig
from kv_transfer import make_sender
from kv_transfer.base import BlockLayout, KVSender, TransferHandle, TransferPayload

logger = logging.getLogger("ray.serve")

# Reads of the decoders' load an encoder goes on with after its last window: windows that come
# with short gaps between them (a request's next ones, a live turn's passes) keep a fresh reading.
_IDLE_POLLS = 10


@dataclass(frozen=True)
class EncoderStats:
    windows_encoded: int
    batches: int
    encoder_forwards: int  # a batch runs one for each context among its windows
    last_batch_size: int
    mean_batch_size: float
    num_staged: int
    num_pending: int  # windows queued or in the forward now
    node_id: str  # the Ray node the replica runs on (placement by resources is checked with it)
    connector: str  # the transfer connector in use ("nixl", "object_store", "local"; colocated: "none")
    payload: str  # what is shipped: "cross_kv" or "encoder_states" (colocated: handed over in process)
    precision: str  # the encoder's precision path, e.g. "bfloat16 on CPU" (EngineConfig.encoder_precision)
    # Sums since start, for where a window's time goes (/metrics; benchmarks/bench_load.py):
    queued_s: float = 0.0  # each window's wait in the queue, from arrival to its forward's start
    window_forward_s: float = 0.0  # each window's forward: its batch's encode, and staging up to its own
    busy_s: float = 0.0  # forwards' time: how much of the replica's time it encodes
    worker_s: float = 0.0  # of busy_s, the forwards' time on their worker thread
    gpu_wait_s: float | None = None  # of worker_s, waiting for the kernels (None: not measured)

    @classmethod
    def of(
        cls,
        batcher: WindowBatcher,
        config: AppConfig,
        num_staged: int,
        connector: str,
        payload: str,
        gpu_wait_s: float | None = None,
    ) -> EncoderStats:
        return cls(
            windows_encoded=batcher.windows_encoded,
            batches=batcher.batches,
            encoder_forwards=batcher.encoder_forwards,
            last_batch_size=batcher.last_batch_size,
            mean_batch_size=batcher.mean_batch_size,
            num_staged=num_staged,
            num_pending=batcher.num_pending,
            node_id=ray.get_runtime_context().get_node_id(),
            connector=connector,
            payload=payload,
            precision=config.engine.encoder_precision,
            queued_s=batcher.queued_s,
            window_forward_s=batcher.window_forward_s,
            busy_s=batcher.busy_s,
            worker_s=batcher.worker_s,
            gpu_wait_s=gpu_wait_s,
        )


def window_layout(dims: ModelDims, engine: EngineConfig, kind: TransferPayload) -> BlockLayout:
    """How one window's payload of ``kind`` is staged: each decoder layer's cross-attention K/V in the
    cache's dtype, or the encoder's states in the model's."""
    if kind == "cross_kv":
        shape, dtype = dims.cross_kv_shape, engine.kv_cache_torch_dtype
    else:
        shape, dtype = (dims.n_audio_ctx, dims.d_model), engine.torch_dtype
    return BlockLayout.of(torch.empty(shape, dtype=dtype, device="meta"), kind, engine.block_size)


def _check_staging_holds_a_window(
    config: AppConfig, dims: ModelDims, kind: TransferPayload, sender: KVSender
) -> None:
    """Every window would fail where staging cannot hold one. A batch may outgrow the staging: its
    windows are handed on one by one as they are staged (deployments/window_batcher.py), and later
    ones wait up to ``transfer.stage_wait_s`` for decoders to pull earlier ones; that wait is logged."""
    window = window_layout(dims, config.engine, kind)
    held = sender.holds_at_once(window)
    batch = config.encoder.max_batch_size
    window_mb, batch_mb = (math.ceil(n * sender.staged_bytes(window) / 2**20) for n in (1, batch))
    if held == 0:
        raise ConfigError(
            f"transfer.staging_memory_mb ({config.transfer.staging_memory_mb:g}) cannot hold one of this "
            f"model's windows ({kind}, {window.nbytes / 2**20:.1f} MB): raise it to at least {window_mb}, "
            f"or to {batch_mb} to stage a whole encoder batch ({batch} windows) without waiting for pulls."
        )
    if held < batch:
        logger.warning(
            "transfer.staging_memory_mb (%g) holds %d of an encoder batch's %d windows: a forward's later "
            "windows wait for decoders to pull earlier ones; %d MB holds a whole batch",
            config.transfer.staging_memory_mb,
            held,
            batch,
            batch_mb,
        )


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
        self.payload = config.transfer.resolved_mode()
        self.sender = make_sender(
            config.transfer, block_size=config.engine.block_size, device=config.engine.torch_device
        )
        try:
            _check_staging_holds_a_window(config, self.loaded.weights.dims, self.payload, self.sender)
        except ConfigError:
            self.sender.close()
            raise
        # Compiles and warms the encoder where it is compiled, and captures its graphs.
        self.runner = EncoderRunner(
            self.loaded,
            graph_batch_size=config.encoder.max_batch_size,
            contexts=config.realtime.partial_context_frames(),
        )
        logger.info(
            "encoder replica prepared in %.1f s: %s loaded in %.1f s, encoder (%s, attention: %s, "
            "compiled: %s) ready in %.1f s",
            time.perf_counter() - started,
            config.engine.model,
            loaded_s,
            config.engine.encoder_precision,
            self.runner.attention,
            config.engine.gpu_switches().compile_encoder,
            time.perf_counter() - started - loaded_s,
        )
        logger.info("encoder: %s transfer, shipping %s", config.transfer.resolved_connector(), self.payload)
        self.batcher = WindowBatcher(
            self._encode_and_stage,
            config.encoder.max_batch_size,
            config.engine.batch_aging_s,
            fill_wait_ms=lambda: config.encoder.fill_wait_ms(self._decoder_occupancy),
            discard=lambda handle: self.sender.release(handle.request_id),
            batch_share=config.engine.batch_share,
        )
        self._decoder = decoder  # read for its load only; windows reach it through the ingress
        self._decoder_occupancy = 0.0  # as last read; 0 (room) until read, or when the read fails
        self._load_watch: asyncio.Task | None = None

    async def encode(self, job: WindowJob) -> TransferHandle:
        """Encode one window (batched with others waiting meanwhile) and stage its payload."""
        if self._decoder is not None and (self._load_watch is None or self._load_watch.done()):
            self._load_watch = asyncio.create_task(self._watch_decoder_load())
        return await self.batcher.submit(job)

    async def _watch_decoder_load(self) -> None:
        """Read the decoders' load while this encoder has windows, and a few polls past its last:
        an idle encoder asks nothing (each read is a call that costs both replicas CPU time), and
        reads 0, room, as before its first read. ``encode`` starts the watch again."""
        idle_polls = 0
        while idle_polls < _IDLE_POLLS:
            try:
                self._decoder_occupancy = await self._decoder.occupancy.remote()
            except Exception:  # a decoder replica restarting: assume room, so no window waits for it
                logger.debug("could not read the decoders' load", exc_info=True)
                self._decoder_occupancy = 0.0
            await asyncio.sleep(self.config.encoder.decoder_load_poll_ms / 1000)
            # No await from this check to the return: a window that arrives after it finds the
            # watch done and starts another.
            idle_polls = 0 if self.num_pending else idle_polls + 1
        self._decoder_occupancy = 0.0

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; deployments/autoscaling.py reads it."""
        return {PENDING_WINDOWS: self.num_pending}

    @property
    def num_pending(self) -> int:
        """Windows queued or in the forward now."""
        return self.batcher.num_pending

    def _encode_and_stage(self, jobs: list[WindowJob]) -> Iterator[TransferHandle | Exception]:
        """Each window's handle (or what failed it) as soon as that window is staged: on a worker
        thread, whose staging waits for room while earlier windows are pulled."""
        started = time.perf_counter()

        def encode(frames: int | None, context_jobs: list[WindowJob]) -> torch.Tensor:
            states = self.runner.encode([job.samples for job in context_jobs], frames)
            return self.runner.cross_kv(states) if self.payload == "cross_kv" else states

        for job, payload in zip(jobs, encode_by_context(jobs, encode)):
            try:
                outcome = self.sender.stage(job.request_id, payload, self.payload)
            except Exception as error:  # back-pressure or a transport error fails this window only
                outcome = error
            yield outcome
        logger.debug("encoded and staged %d windows in %.3f s", len(jobs), time.perf_counter() - started)

    def stats(self) -> EncoderStats:
        return EncoderStats.of(
            self.batcher,
            self.config,
            self.sender.num_staged,
            self.config.transfer.resolved_connector(),
            self.payload,
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
