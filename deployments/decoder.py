"""DecoderDeployment: the decoder replica Serve runs. It answers Serve's calls and forwards each to
its DecoderCore (deployments/decoder_core.py: the engine, its loop and, colocated, the encoder),
which runs in the replica's process or, with ``decoder.engine_process``, in a process of its own
(deployments/engine_process.py), where Serve's per-call Python never shares the decode loop's
interpreter.

A caller that goes away cancels its call here, and the cancellation reaches the core, which aborts
the window and frees its blocks. If the engine's process dies, every call in flight fails at once
and the health check fails, so Serve replaces the replica.
"""

from __future__ import annotations

import logging
import time

import ray

from deployments.config import AppConfig
from deployments.decoder_core import DecoderCore, DecoderStats
from deployments.encoder import EncoderStats
from deployments.engine_process import EngineProcess, EngineProcessExited, InProcessEngine
from deployments.window_batcher import WindowJob
from engine.types import DecodeOptions, DecodeResult, Priority
from kv_transfer.base import TransferHandle

logger = logging.getLogger("ray.serve")


class DecoderDeployment:
    def __init__(self, config: AppConfig):
        started = time.perf_counter()
        node_id = ray.get_runtime_context().get_node_id()
        if config.decoder.engine_process:
            self.core: EngineProcess | InProcessEngine = EngineProcess(DecoderCore, config, node_id)
            ready_info = self.core.ready_info
        else:
            core = DecoderCore(config, node_id)
            self.core, ready_info = InProcessEngine(core), core.ready_info
        logger.info(
            "decoder replica ready in %.1f s (%s): %s",
            time.perf_counter() - started,
            "engine in its own process"
            if config.decoder.engine_process
            else "engine in the replica's process",
            ready_info,
        )

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process is gone is replaced."""
        if not self.core.alive:
            raise EngineProcessExited("the engine process has exited")

    async def check_options(self, options: DecodeOptions) -> None:
        """Raise RequestRejectedError if this model cannot decode with ``options`` (checked before
        any window is encoded, so a bad request costs no encoder work)."""
        await self.core.call("check_options", options)

    async def occupancy(self) -> float:
        """Running and waiting windows over ``max_num_seqs`` (encoder replicas batch by it)."""
        return await self.core.call("occupancy")

    async def discard(self, handle: TransferHandle) -> None:
        """Free the staged K/V ``handle`` points at, which no decoder will pull. Best effort."""
        await self.core.call("discard", handle)

    async def decode(
        self,
        handle: TransferHandle,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Decode one window whose cross-attention K/V (or states) the handle points at."""
        return await self.core.call("decode", handle, options, audio_duration_s, priority)

    async def transcribe_window(
        self,
        job: WindowJob,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Colocated: encode one window (batched with others waiting) and decode it."""
        return await self.core.call("transcribe_window", job, options, audio_duration_s, priority)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; deployments/autoscaling.py reads it."""
        return await self.core.call("record_autoscaling_stats")

    def record_routing_stats(self) -> dict[str, int]:
        """Serve calls this every routing_stats_period_s; deployments/routing.py ranks replicas by it."""
        return self.core.call_blocking("record_routing_stats")

    async def encoder_stats(self) -> EncoderStats:
        """Colocated: the in-process encoder's figures, as an encoder replica reports its own."""
        return await self.core.call("encoder_stats")

    async def stats(self) -> DecoderStats:
        return await self.core.call("stats")

    def __del__(self):
        # On scale-down Serve calls this only after every decode call has returned.
        core = getattr(self, "core", None)
        if core is not None:
            core.close()
