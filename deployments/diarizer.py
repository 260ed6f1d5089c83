"""DiarizerDeployment: who speaks when, as a Serve deployment of its own beside the models' encoders
and decoders, fed the same decoded audio by the ingress while the windows are transcribed.

A thin shell around engine/diarize's ``Diarizer``: Serve's ``serve.batch`` gathers the recordings
of concurrent requests so their windows share the speaker encoder's batches, and the work runs on a
worker thread so the replica keeps taking calls meanwhile. One deployment serves the whole app:
speakers do not depend on the Whisper model. Under ``placement: colocated`` it still runs beside the
model's replicas rather than inside them: it is one deployment for every model, CPU by default
(it takes nothing from the GPU the colocated replica owns), and it scales on its own load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from ray import serve

from deployments.replica_options import DiarizerOptions
from engine import DiarizationRequest, Diarizer, SpeakerEncoderOptions, SpeakerTurn, match_known_speakers

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class DiarizerJob:
    """What the ingress sends: one recording (16 kHz mono float32, with its speaker bounds) and the
    known speakers' reference clips by name, each of only that speaker."""

    request: DiarizationRequest
    references: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class SpeakerTimeline:
    """What comes back: the recording's speaker turns (speakers numbered from 0 in the order they
    first speak), the known speaker's name each matched speaker takes, and the names whose reference
    held no speech to take a voice from (the request's fault: a 400)."""

    turns: list[SpeakerTurn]
    names: dict[int, str] = field(default_factory=dict)
    silent_references: tuple[str, ...] = ()


class DiarizerDeployment:
    def __init__(self, options: DiarizerOptions):
        started = time.perf_counter()
        self.diarizer = Diarizer(
            SpeakerEncoderOptions(
                device=options.device,
                batch_size=options.embedding_batch_size,
                threads=options.torch_threads,
            )
        )
        self._diarize_batch.set_max_batch_size(options.max_batch_size)
        self._diarize_batch.set_batch_wait_timeout_s(options.batch_wait_timeout_ms / 1000)
        logger.info(
            "diarizer replica prepared in %.1f s (speaker encoder on %s)",
            time.perf_counter() - started,
            options.device,
        )

    async def diarize(self, job: DiarizerJob) -> SpeakerTimeline:
        """One recording's speakers, its windows embedded with those of the recordings waiting now."""
        return await self._diarize_batch(job)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _diarize_batch(self, jobs: list[DiarizerJob]) -> list[SpeakerTimeline]:
        # One batch at a time (serve.batch's default): the speaker encoder is not thread-safe.
        return await asyncio.to_thread(self._timelines, jobs)

    def _timelines(self, jobs: list[DiarizerJob]) -> list[SpeakerTimeline]:
        diarizations = self.diarizer.diarize([job.request for job in jobs])
        timelines = []
        for job, diarization in zip(jobs, diarizations):
            voices = {
                name: self.diarizer.voice_embedding(samples) for name, samples in job.references.items()
            }
            silent = tuple(name for name, voice in voices.items() if voice is None)
            known = {name: voice for name, voice in voices.items() if voice is not None}
            names = match_known_speakers(diarization.centroids, known) if known else {}
            timelines.append(SpeakerTimeline(diarization.turns, names, silent))
        return timelines
