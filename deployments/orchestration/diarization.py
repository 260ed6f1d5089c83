"""A request's recording through the diarizer deployment, beside its windows: one call, tried again
once on another replica when the one it went to is lost (killed, crashed, restarting). The call
holds nothing in the diarizer between attempts, so a retry costs only the diarizer's time.
"""

from __future__ import annotations

import logging

from ray.serve.handle import DeploymentHandle

from deployments.diarizer import DiarizerJob, SpeakerTimeline
from deployments.orchestration.pipeline import REPLICA_LOST
from engine.errors import RetriableError

logger = logging.getLogger("ray.serve")

DIARIZE_ATTEMPTS = 2


class DiarizationClient:
    def __init__(self, diarizer: DeploymentHandle):
        # Follow the deployment from now on: a handle that learns only at its first call that the
        # deployment failed to start would wait for a replica forever instead of failing at once.
        self.diarizer = diarizer.options()

    async def diarize(self, job: DiarizerJob) -> SpeakerTimeline:
        failure = "no attempt made"
        for attempt in range(DIARIZE_ATTEMPTS):
            try:
                return await self.diarizer.diarize.remote(job)
            except REPLICA_LOST as error:
                failure = f"a diarizer replica was lost ({type(error).__name__})"
                logger.warning("diarization: %s; trying again (attempt %d)", failure, attempt + 1)
        raise RetriableError(f"diarization failed {DIARIZE_ATTEMPTS} times; last: {failure}")
