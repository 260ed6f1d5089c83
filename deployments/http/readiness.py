"""Readiness, as Kubernetes probes expect it: ``/ready`` answers 503 until a warm-up window has gone
through the whole path (an encoder replica, a K/V transfer, a decoder replica) and 200 after; with
several models, each model's own path, each warmed up on its own (``models_readiness``). An app
with a diarizer is ready once a warm-up clip has come back from a diarizer replica too
(``DiarizerReadiness``): until then a diarized request would wait for one to start.

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
from collections.abc import Awaitable, Callable

import numpy as np

from deployments.http.errors import APIError
from deployments.orchestration.diarization import DiarizationClient
from deployments.orchestration.pipeline import WindowPipeline
from engine import SAMPLE_RATE
from engine.types import DecodeOptions, Priority

logger = logging.getLogger("ray.serve")

WARM_UP_AUDIO_S = 1.0
# A warm-up that waits longer is given up and tried again at the next probe: a call sent while its
# deployment is failing to start may wait for a replica forever, where a fresh one fails at once.
WARM_UP_TIMEOUT_S = 30.0


def _silence() -> np.ndarray:
    return np.zeros(int(WARM_UP_AUDIO_S * SAMPLE_RATE), dtype=np.float32)


class Readiness:
    """One part's readiness: a warm-up call through it (``warm_up``, made anew at each try) that has
    come back; ``proof`` says in the log what its answer proved."""

    def __init__(self, warm_up: Callable[[], Awaitable], proof: str):
        self.warm_up = warm_up
        self.proof = proof
        self.warm_up_s: float | None = None  # how long the warm-up took, once it has succeeded
        self.last_error: str | None = None
        self._warming_up: asyncio.Task | None = None

    @classmethod
    def of_pipeline(cls, pipeline: WindowPipeline) -> Readiness:
        """A model's: a warm-up window through its pipeline."""

        def warm_up() -> Awaitable:
            return pipeline.decode_window(
                f"warm-up-{uuid.uuid4().hex}", _silence(), DecodeOptions(max_tokens=1), Priority.INTERACTIVE
            )

        return cls(warm_up, "a warm-up window went through an encoder, a transfer and a decoder")

    @classmethod
    def of_diarizer(cls, diarization: DiarizationClient) -> Readiness:
        """The diarizer's: a second of silence through a diarizer replica's voice call (its speaker
        encoder is loaded before a replica takes calls, so an answer proves one serves)."""
        return cls(
            lambda: diarization.voice_embedding(_silence()),
            "a warm-up clip came back from a diarizer replica",
        )

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
        try:
            await asyncio.wait_for(self.warm_up(), WARM_UP_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.last_error = f"no answer within {WARM_UP_TIMEOUT_S:g} s; its replicas may still be starting"
            logger.warning("warm-up: %s; the next readiness probe tries again", self.last_error)
            return
        except Exception as error:
            self.last_error = str(error) or type(error).__name__
            logger.warning("warm-up failed (%s); the next readiness probe tries again", self.last_error)
            return
        self.warm_up_s = time.perf_counter() - started
        logger.info("ready: %s in %.2f s", self.proof, self.warm_up_s)

    def state(self) -> dict:
        """``ready``, then ``warm_up_s`` or the last warm-up's error; one that is not ready starts
        a warm-up."""
        if self.check():
            return {"ready": True, "warm_up_s": round(self.warm_up_s, 3)}
        return {"ready": False, "last_error": self.last_error}


def models_readiness(models: dict[str, Readiness]) -> tuple[bool, dict[str, dict]]:
    """Whether every model is ready, and each one's state (``Readiness.state``). One model's
    warm-up never waits on another's."""
    states = {name: readiness.state() for name, readiness in models.items()}
    return all(state["ready"] for state in states.values()), states


def not_ready(states: dict[str, dict], diarizer: dict | None = None) -> APIError:
    """The 503 for models not ready yet (``models_readiness``'s states) or a diarizer not ready yet
    (its ``state``), naming them and the models ready."""
    waiting = [name for name, state in states.items() if not state["ready"]]
    errors = [f"{name}: {states[name]['last_error']}" for name in waiting if states[name]["last_error"]]
    ready = [name for name, state in states.items() if state["ready"]]
    missing = []
    if waiting:
        missing.append(
            f"no window has gone through the encoder and decoder of {', '.join(waiting)} yet"
            + (f" (last warm-up: {'; '.join(errors)})" if errors else "")
        )
    if diarizer is not None and not diarizer["ready"]:
        last = diarizer["last_error"]
        missing.append(
            "no warm-up clip has come back from a diarizer replica yet"
            + (f" (last warm-up: {last})" if last else "")
        )
    return APIError(
        503,
        "The server is warming up: "
        + "; ".join(missing)
        + "."
        + (f" Ready: {', '.join(ready)}." if ready else ""),
        error_type="server_error",
        code="not_ready",
        retry_after_s=1,
    )
