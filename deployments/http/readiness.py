"""Readiness, as Kubernetes probes expect it: ``/ready`` answers 503 until a warm-up window has gone
through the whole path (an encoder replica, a K/V transfer, a decoder replica) and 200 after; with
several models, each model's own path, each warmed up on its own (``models_readiness``).

``/health`` says only that the ingress answers (liveness). A replica is constructed with its
preparation done (weights loaded, the encoder compiled, decode CUDA graphs captured: each logs
how long it took), so one short window through both sides proves that they serve and that the
transfer path between them works. The first probe starts the warm-up; a failed warm-up is tried
again at the next probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import numpy as np

from deployments.http.errors import APIError
from deployments.orchestration.pipeline import WindowPipeline
from engine import SAMPLE_RATE
from engine.types import DecodeOptions, Priority

logger = logging.getLogger("ray.serve")

WARM_UP_AUDIO_S = 1.0
# A warm-up that waits longer is given up and tried again at the next probe: a call sent while its
# deployment is failing to start may wait for a replica forever, where a fresh one fails at once.
WARM_UP_TIMEOUT_S = 30.0


class Readiness:
    def __init__(self, pipeline: WindowPipeline):
        self.pipeline = pipeline
        self.warm_up_s: float | None = None  # how long the warm-up window took, once it has succeeded
        self.last_error: str | None = None
        self._warming_up: asyncio.Task | None = None

    @property
    def is_ready(self) -> bool:
        return self.warm_up_s is not None

    def check(self) -> bool:
        """Whether the app is ready; if not, start a warm-up unless one is running."""
        if not self.is_ready and (self._warming_up is None or self._warming_up.done()):
            self._warming_up = asyncio.ensure_future(self._warm_up())
        return self.is_ready

    async def _warm_up(self) -> None:
        started = time.perf_counter()
        silence = np.zeros(int(WARM_UP_AUDIO_S * SAMPLE_RATE), dtype=np.float32)
        warm_up = self.pipeline.decode_window(
            f"warm-up-{uuid.uuid4().hex}", silence, DecodeOptions(max_tokens=1), Priority.INTERACTIVE
        )
        try:
            await asyncio.wait_for(warm_up, WARM_UP_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.last_error = f"no answer within {WARM_UP_TIMEOUT_S:g} s; its replicas may still be starting"
            logger.warning("warm-up window: %s; the next readiness probe tries again", self.last_error)
            return
        except Exception as error:
            self.last_error = str(error) or type(error).__name__
            logger.warning(
                "warm-up window failed (%s); the next readiness probe tries again", self.last_error
            )
            return
        self.warm_up_s = time.perf_counter() - started
        logger.info(
            "ready: a warm-up window went through an encoder, a transfer and a decoder in %.2f s",
            self.warm_up_s,
        )


def models_readiness(models: dict[str, Readiness]) -> tuple[bool, dict[str, dict]]:
    """Whether every model is ready, and each one's state (`ready`, then `warm_up_s` or the last
    warm-up's error); a model that is not starts a warm-up. One model's warm-up never waits on another's."""
    states = {}
    for name, readiness in models.items():
        if readiness.check():
            states[name] = {"ready": True, "warm_up_s": round(readiness.warm_up_s, 3)}
        else:
            states[name] = {"ready": False, "last_error": readiness.last_error}
    return all(state["ready"] for state in states.values()), states


def not_ready(states: dict[str, dict]) -> APIError:
    """The 503 for models not ready yet (``models_readiness``'s states), naming them and those ready."""
    waiting = [name for name, state in states.items() if not state["ready"]]
    errors = [f"{name}: {states[name]['last_error']}" for name in waiting if states[name]["last_error"]]
    ready = [name for name, state in states.items() if state["ready"]]
    return APIError(
        503,
        f"The server is warming up: no window has gone through the encoder and decoder of "
        f"{', '.join(waiting)} yet"
        + (f" (last warm-up: {'; '.join(errors)})" if errors else "")
        + "."
        + (f" Ready: {', '.join(ready)}." if ready else ""),
        error_type="server_error",
        code="not_ready",
        retry_after_s=1,
    )
