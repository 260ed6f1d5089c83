"""ColocatedEncoder: a decoder replica's own encoder (``placement: colocated``).

Windows arrive as audio, are batched (deployments/window_batcher.py) and encoded on a CUDA stream of
their own beside the decode loop's, and their encoder states go to the engine in process, which
projects them into cross-attention K/V at admission. On one GPU that is the difference between
kernels that run side by side (two streams of one process) and kernels that take turns (two
processes without MPS), and nothing travels. A forward starts only while few encoded windows wait
for admission, so encoded states never pile up in GPU memory; the audio waits instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from deployments.config import AppConfig
from deployments.encoder import EncoderStats
from deployments.window_batcher import WindowBatcher, WindowJob, encode_by_context
from engine import EncoderRunner, EncoderStates, LoadedModel, OverlappedEncoder


class ColocatedEncoder:
    def __init__(
        self,
        loaded: LoadedModel,
        config: AppConfig,
        decoder_occupancy: Callable[[], float],
        windows_awaiting_admission: Callable[[], int],
    ):
        """``decoder_occupancy`` sets how long a forward waits to fill; ``windows_awaiting_admission``
        holds forwards back while a batch of encoded windows already waits for the decoder."""
        self.config = config
        self._awaiting_admission = windows_awaiting_admission
        # Compiles and warms the encoder where it is compiled.
        self.encoder = OverlappedEncoder(
            EncoderRunner(
                loaded,
                graph_batch_size=config.encoder.max_batch_size,
                contexts=config.realtime.partial_context_frames(),
            ),
            project_cross_kv=False,
        )
        self.batcher = WindowBatcher(
            self._encode_windows,
            config.encoder.max_batch_size,
            config.engine.batch_aging_s,
            fill_wait_ms=lambda: config.encoder.fill_wait_ms(decoder_occupancy()),
            may_start=self._may_encode,
            batch_share=config.engine.batch_share,
        )

    async def encode(self, job: WindowJob) -> EncoderStates:
        """One window's encoder states, once its batch's forward is done."""
        return EncoderStates(await self.batcher.submit(job))

    def stats(self) -> EncoderStats:
        """The figures an encoder replica reports of its own."""
        return EncoderStats.of(
            self.batcher, self.config, 0, "none", "encoder_states", gpu_wait_s=self.encoder.gpu_wait_s
        )

    def _encode_windows(self, jobs: list[WindowJob]) -> Iterator[torch.Tensor]:
        """Each window's encoder states, one [frames, d] view each, as its context's forward ends (on
        a worker thread)."""

        def encode(frames: int | None, context_jobs: list[WindowJob]) -> torch.Tensor:
            return self.encoder.encode_blocking([job.samples for job in context_jobs], frames)

        return encode_by_context(jobs, encode)

    def _may_encode(self) -> bool:
        """Encode more only while fewer than a batch of encoded windows wait for admission."""
        return self._awaiting_admission() < self.config.encoder.max_batch_size
