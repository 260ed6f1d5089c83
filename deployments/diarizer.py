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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from ray import serve

from deployments.replica_options import DiarizerOptions
from engine import (
    SAMPLE_RATE,
    DiarizationRequest,
    Diarizer,
    SpeakerEncoderOptions,
    SpeakerTurn,
    match_known_speakers,
)

logger = logging.getLogger("ray.serve")

T = TypeVar("T")
R = TypeVar("R")


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


@dataclass(frozen=True)
class DiarizerStats:
    """A diarizer replica's figures for /metrics, counted since it started (differences over an
    interval give rates and means)."""

    waiting: int  # calls this replica holds now: queued for a batch or in one
    recordings: int  # recordings diarized
    audio_s: float  # their audio
    batches: int  # diarize batches run (recordings / batches: the mean batch)
    busy_s: float  # time the speaker encoder's thread spent on diarize batches
    voices: int  # voice embeddings (live turns, warm-ups)
    own_speech_passes: int  # recordings whose speech the replica had to find itself (no VAD pass came)


class DiarizerDeployment:
    def __init__(self, options: DiarizerOptions):
        started = time.perf_counter()
        self._waiting = 0
        self._recordings = 0
        self._audio_s = 0.0
        self._batches = 0
        self._busy_s = 0.0
        self._voices_embedded = 0
        self._own_speech_passes = 0
        self.diarizer = Diarizer(
            SpeakerEncoderOptions(
                device=options.device,
                batch_size=options.embedding_batch_size,
                threads=options.threads,
            )
        )
        self._encoder_lock = threading.Lock()
        for batch in (self._diarize_batch, self._voice_batch):
            batch.set_max_batch_size(options.max_batch_size)
            batch.set_batch_wait_timeout_s(options.batch_wait_timeout_ms / 1000)
        logger.info(
            "diarizer replica prepared in %.1f s (speaker encoder on %s)",
            time.perf_counter() - started,
            options.device,
        )

    async def diarize(self, job: DiarizerJob) -> SpeakerTimeline:
        """One recording's speakers, its windows embedded with those of the recordings waiting now."""
        self._waiting += 1
        try:
            return await self._diarize_batch(job)
        finally:
            self._waiting -= 1

    async def voice_embedding(self, samples: np.ndarray) -> np.ndarray | None:
        """One speaker's voice in a stretch of audio (16 kHz mono float32): the mean embedding of its
        speech windows, or None when it holds no speech. A live turn's, for its session's speakers."""
        self._waiting += 1
        try:
            return await self._voice_batch(samples)
        finally:
            self._waiting -= 1

    def stats(self) -> DiarizerStats:
        return DiarizerStats(
            waiting=self._waiting,
            recordings=self._recordings,
            audio_s=self._audio_s,
            batches=self._batches,
            busy_s=self._busy_s,
            voices=self._voices_embedded,
            own_speech_passes=self._own_speech_passes,
        )

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _diarize_batch(self, jobs: list[DiarizerJob]) -> list[SpeakerTimeline]:
        return await self._on_encoder(self._timelines, jobs)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _voice_batch(self, clips: list[np.ndarray]) -> list[np.ndarray | None]:
        return await self._on_encoder(self._voices, clips)

    async def _on_encoder(self, work: Callable[[T], R], batch: T) -> R:
        """Run a batch's work on a worker thread, so the replica keeps taking calls, one at a time:
        the speaker encoder is not thread-safe, and each batch queue only keeps its own batches apart."""

        def locked() -> R:
            with self._encoder_lock:
                return work(batch)

        return await asyncio.to_thread(locked)

    def _voices(self, clips: list[np.ndarray]) -> list[np.ndarray | None]:
        self._voices_embedded += len(clips)
        return [self.diarizer.voice_embedding(samples) for samples in clips]

    def _timelines(self, jobs: list[DiarizerJob]) -> list[SpeakerTimeline]:
        started = time.perf_counter()
        try:
            return self._named_timelines(jobs)
        finally:
            # Counted on the worker thread, under the encoder's lock: one writer at a time.
            self._batches += 1
            self._recordings += len(jobs)
            self._audio_s += sum(len(job.request.samples) for job in jobs) / SAMPLE_RATE
            self._own_speech_passes += sum(job.request.speech_probabilities is None for job in jobs)
            self._busy_s += time.perf_counter() - started

    def _named_timelines(self, jobs: list[DiarizerJob]) -> list[SpeakerTimeline]:
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
