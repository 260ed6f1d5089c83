"""Every replica of a deployment asked for its figures at once (a /metrics scrape): the encoders',
decoders' and diarizer's ``stats``."""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle

STATS_TIMEOUT_S = 5.0


async def answered(deployment: DeploymentHandle, method: str) -> list:
    """What the replicas of ``deployment`` answer to ``method`` in time; none when one is late:
    Serve raises for the whole broadcast then, and a scrape must not fail (500) for a slow
    replica."""
    try:
        results = await deployment.broadcast(method).results_async(
            timeout_s=STATS_TIMEOUT_S, return_exceptions=True
        )
    except TimeoutError:
        return []
    return [result for result in results if not isinstance(result, Exception)]
