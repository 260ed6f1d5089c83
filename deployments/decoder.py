"""DecoderDeployment: the decoder replica Serve runs, a thin shell. It answers Serve's calls by
calling its engine through ``DecoderAPI`` (deployments/decoder_api.py): a DecoderService
(deployments/decoder_service.py: the engine, its loop and, colocated, the encoder) in the replica's
process or, with ``decoder.engine_process``, in a process of its own (deployments/engine_process.py),
where Serve's per-call Python never shares the decode loop's interpreter.

A caller that goes away cancels its call here, and the cancellation reaches the service, which
aborts the window and frees its blocks. If the engine's process dies, every call in flight fails at
once and the health check fails, so Serve replaces the replica.
"""

from __future__ import annotations

import logging
import time

import ray

from deployments.config import AppConfig
from deployments.decoder_api import Decode, DecoderAPI, RemoteDecoder, TranscribeWindow
from deployments.decoder_service import DecoderService
from deployments.decoder_stats import DecoderStats
from deployments.encoder import EncoderStats
from deployments.engine_process import EngineProcess, EngineProcessExited
from deployments.window_batcher import WindowJob
from engine.errors import RequestRejectedError
from engine.types import DecodeOptions, DecodeResult, Priority
from kv_transfer.base import TransferHandle

logger = logging.getLogger("ray.serve")


class DecoderDeployment:
    def __init__(self, config: AppConfig):
        started = time.perf_counter()
        node_id = ray.get_runtime_context().get_node_id()
        if config.decoder.engine_process:
            remote = RemoteDecoder(EngineProcess(DecoderService, config, node_id))
            self.engine: DecoderAPI = remote
            ready_info, where = remote.ready_info, "engine in its own process"
        else:
            service = DecoderService(config, node_id)
            self.engine = service
            ready_info, where = service.ready_info, "engine in the replica's process"
        logger.info(
            "decoder replica ready in %.1f s (%s): %s", time.perf_counter() - started, where, ready_info
        )

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process is gone is replaced."""
        if not self.engine.alive:
            raise EngineProcessExited("the engine process has exited")

    async def check_options(self, options: DecodeOptions) -> RequestRejectedError | None:
        """The RequestRejectedError of options this model cannot decode with, None for options it
        can (checked before any window is encoded, so a bad request costs no encoder work).

        Returned, not raised: Serve logs every exception a replica's method raises as an ERROR with
        its traceback, and a client's bad option is no fault of the server's. One line at INFO, with
        the request id Serve adds to it, records it."""
        try:
            await self.engine.check_options(options)
        except RequestRejectedError as rejection:
            logger.info("a request's options were rejected (400): %s", rejection)
            return rejection
        return None

    async def occupancy(self) -> float:
        """Running and waiting windows over ``max_num_seqs`` (encoder replicas batch by it)."""
        return await self.engine.occupancy()

    async def discard(self, handle: TransferHandle) -> None:
        """Free the staged K/V ``handle`` points at, which no decoder will pull. Best effort."""
        await self.engine.discard(handle)

    async def decode(
        self,
        handle: TransferHandle,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Decode one window whose cross-attention K/V (or states) the handle points at."""
        return await self.engine.decode(Decode(handle, options, audio_duration_s, priority))

    async def transcribe_window(
        self,
        job: WindowJob,
        options: DecodeOptions,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> DecodeResult:
        """Colocated: encode one window (batched with others waiting) and decode it."""
        return await self.engine.transcribe_window(TranscribeWindow(job, options, audio_duration_s, priority))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; deployments/autoscaling.py reads it."""
        return await self.engine.autoscaling_stats()

    def record_routing_stats(self) -> dict[str, int]:
        """Serve calls this every routing_stats_period_s; deployments/routing.py ranks replicas by it."""
        return self.engine.routing_stats()

    async def encoder_stats(self) -> EncoderStats:
        """Colocated: the in-process encoder's figures, as an encoder replica reports its own."""
        return await self.engine.encoder_stats()

    async def stats(self) -> DecoderStats:
        return await self.engine.stats()

    def __del__(self):
        # On scale-down Serve calls this only after every decode call has returned.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
