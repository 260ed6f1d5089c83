"""EncoderDeployment: batches 30 s windows from many requests into one encoder forward, then
stages each window's cross-attention K/V (or encoder states) with the transfer layer."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from ray import serve

from deployments.config import AppConfig
from engine.audio import pad_or_trim
from engine.engine import EncoderRunner, load_model
from kv_transfer import make_sender
from kv_transfer.base import TransferHandle

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class WindowJob:
    """One window to encode: what crosses from the ingress to the encoder."""

    request_id: str  # unique per window; the transfer handle carries it to the decoder
    samples: np.ndarray  # float32, 16 kHz mono, at most 30 s


@dataclass(frozen=True)
class EncoderStats:
    windows_encoded: int
    batches: int
    last_batch_size: int
    mean_batch_size: float
    num_staged: int
    connector: str  # the transfer connector really in use ("nixl", "object_store", "local")
    payload: str  # what is shipped: "cross_kv" or "encoder_states"


class EncoderDeployment:
    def __init__(self, config: AppConfig):
        if config.encoder.torch_threads:
            torch.set_num_threads(config.encoder.torch_threads)
        self.config = config
        self.loaded = load_model(config.engine)
        self.runner = EncoderRunner(self.loaded)
        self.payload = config.transfer.resolved_mode()
        self.sender = make_sender(config.transfer, block_size=config.engine.block_size, device=config.engine.torch_device)
        logger.info("encoder: %s transfer, shipping %s", config.transfer.resolved_connector(), self.payload)
        self._encode_batch.set_max_batch_size(config.encoder.max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(config.encoder.batch_wait_timeout_ms / 1000)
        self.windows_encoded = 0
        self.batches = 0
        self.last_batch_size = 0

    async def encode(self, job: WindowJob) -> TransferHandle:
        """Encode one window (batched with others arriving meanwhile) and stage its payload."""
        outcome = await self._encode_batch(job)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @serve.batch
    async def _encode_batch(self, jobs: list[WindowJob]) -> list[TransferHandle | Exception]:
        # The forward runs in a worker thread so this replica's event loop keeps answering
        # health checks and queueing the next batch while the encoder computes.
        return await asyncio.to_thread(self._encode_and_stage, jobs)

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
            connector=self.config.transfer.resolved_connector(),
            payload=self.payload,
        )

    def __del__(self):
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.close()
