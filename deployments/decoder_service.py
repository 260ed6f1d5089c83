"""DecoderService: what a decoder replica runs, in its own process or in the engine's
(deployments/engine_process.py): the model, a DecoderEngine on its loop (deployments/engine_loop.py),
the receiver that pulls cross-attention K/V from encoder replicas or, colocated, the replica's own
encoder (deployments/colocated_encoder.py). It implements ``DecoderAPI`` (deployments/decoder_api.py),
the only way deployments/decoder.py reaches it, and turns the engine's figures into what each reader
wants (deployments/decoder_stats.py).
"""

from __future__ import annotations

import time

import torch

from deployments.colocated_encoder import ColocatedEncoder
from deployments.config import AppConfig
from deployments.decoder_api import Decode, DecoderCall, TranscribeWindow, answer
from deployments.decoder_stats import DecoderStats, RoutingReports, autoscaling_metrics
from deployments.encoder import EncoderStats
from deployments.engine_loop import EngineLoop
from engine import DecoderEngine, freeze_start_up_objects, load_model
from engine.types import DecodeOptions, DecodeResult
from kv_transfer import make_receiver
from kv_transfer.base import TransferHandle
from kv_transfer.source import TransferredCrossKV


class DecoderService:
    def __init__(self, config: AppConfig, node_id: str):
        if config.decoder.torch_threads:
            torch.set_num_threads(config.decoder.torch_threads)
        started = time.perf_counter()
        self.config = config
        self.node_id = node_id
        loaded = load_model(config.engine)
        loaded_s = time.perf_counter() - started
        if not config.colocated:
            # Encoding happens in the encoder replicas: free the encoder's weights here (GPU memory
            # this replica would hold and never use).
            loaded.model.encoder = None
            if config.engine.torch_device.type == "cuda":
                torch.cuda.empty_cache()  # back to the GPU, which an encoder replica may share
        engine = DecoderEngine(loaded)  # sizes the KV cache, captures decode CUDA graphs
        self.loop = EngineLoop(engine)
        self.receiver = None if config.colocated else make_receiver(config.transfer, storage=engine.storage)
        self.encoder = (
            ColocatedEncoder(loaded, config, self.loop.occupancy, lambda: self.loop.stats().num_waiting)
            if config.colocated
            else None
        )
        self._routing_reports = RoutingReports()
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
        self.loop.start()

    def answer(self, message: DecoderCall):
        """A call that crossed from the replica's process (deployments/engine_process.py)."""
        return answer(self, message)

    @property
    def alive(self) -> bool:
        return self.loop.alive

    async def check_options(self, options: DecodeOptions) -> None:
        """Checked before any window is encoded, so a bad request costs no encoder work."""
        self.loop.check_options(options)

    async def occupancy(self) -> float:
        """At or above the encoder's ``decoder_busy_occupancy`` it waits for fuller batches."""
        return self.loop.occupancy()

    async def discard(self, handle: TransferHandle) -> None:
        """Its caller went away before a decoder took it; any decoder replica can tell the sender."""
        if self.receiver is not None:
            self.receiver.discard(handle)

    async def decode(self, call: Decode) -> DecodeResult:
        source = TransferredCrossKV(call.handle, self.receiver)
        return await self.loop.decode(
            source, call.handle.request_id, call.options, call.audio_duration_s, call.priority
        )

    async def transcribe_window(self, call: TranscribeWindow) -> DecodeResult:
        if self.encoder is None:
            raise RuntimeError("transcribe_window is for colocated replicas (placement: colocated)")
        states = await self.encoder.encode(call.job)
        return await self.loop.decode(
            states, call.job.request_id, call.options, call.audio_duration_s, call.priority
        )

    async def autoscaling_stats(self) -> dict[str, float]:
        return autoscaling_metrics(self.loop.stats())

    def routing_stats(self) -> dict[str, int]:
        return self._routing_reports.report(self.loop.stats(), self.loop.engine.blocks_per_window)

    async def encoder_stats(self) -> EncoderStats:
        if self.encoder is None:
            raise RuntimeError("encoder_stats is for colocated replicas (placement: colocated)")
        return self.encoder.stats()

    async def stats(self) -> DecoderStats:
        loop = self.loop
        return DecoderStats.of(
            loop.stats(),
            self.node_id,
            loop.windows_decoded,
            loop.windows_aborted,
            loop.tokens_generated,
            loop.loop_busy_s,
        )

    def close(self) -> None:
        """Ends the loop. On scale-down Serve stops the replica only after every decode call has
        returned (it is out of the router's set and Serve waits up to decoder.drain_timeout_s)."""
        self.loop.close()
