"""A request's recording (or a live turn's voice) through the diarizer deployment, beside its
windows: one call, tried again
once on another replica when the one it went to is lost (killed, crashed, restarting). The call
holds nothing in the diarizer between attempts, so a retry costs only the diarizer's time.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from ray.serve.handle import DeploymentHandle

from deployments.diarizer import DiarizerJob, DiarizerStats, SpeakerTimeline
from deployments.orchestration.pipeline import REPLICA_LOST
from deployments.replica_stats import answered
from engine.errors import RetriableError

logger = logging.getLogger("ray.serve")

DIARIZE_ATTEMPTS = 2


class DiarizationClient:
    def __init__(self, diarizer: DeploymentHandle):
        # Follow the deployment from now on: a handle that learns only at its first call that the
        # deployment failed to start would wait for a replica forever instead of failing at once.
        self.diarizer = diarizer.options()

    async def diarize(self, job: DiarizerJob) -> SpeakerTimeline:
        return await self._call("diarize", job)

    async def voice_embedding(self, samples_16k: np.ndarray) -> np.ndarray | None:
        """The voice of a stretch of audio (a live turn's), or None when it holds no speech."""
        return await self._call("voice_embedding", samples_16k)

    async def replica_stats(self) -> list[DiarizerStats]:
        """Every diarizer replica's figures that answered in time, for /metrics."""
        return await answered(self.diarizer, "stats")

    async def _call(self, method: str, argument: Any) -> Any:
        failure = "no attempt made"
        for attempt in range(DIARIZE_ATTEMPTS):
            try:
                return await getattr(self.diarizer, method).remote(argument)
            except REPLICA_LOST as error:
                failure = f"a diarizer replica was lost ({type(error).__name__})"
                logger.warning("diarization: %s; trying again (attempt %d)", failure, attempt + 1)
        raise RetriableError(f"diarization failed {DIARIZE_ATTEMPTS} times; last: {failure}")
