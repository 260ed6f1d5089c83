"""Readiness model by model, without Ray: each model's warm-up goes through its own pipeline, so a
model whose replicas cannot serve stays not ready, says why, and never holds another back. The
whole app's /ready over HTTP is in tests/deployments/test_models.py and test_serving.py; the
diarizer's warm-up beside the models', in the last tests."""

from __future__ import annotations

import asyncio

from deployments.http.readiness import Readiness, models_readiness, not_ready


class WarmUpPipeline:
    """A model's pipeline as readiness sees it: one warm-up window through it, answered or failed."""

    def __init__(self, failure: Exception | None = None):
        self.failure = failure
        self.windows = 0

    async def decode_window(self, window_id, samples, options, priority) -> None:
        self.windows += 1
        await asyncio.sleep(0)
        if self.failure is not None:
            raise self.failure


def test_a_model_that_cannot_warm_up_is_named_not_ready_while_the_other_is_ready():
    async def probe_twice():
        serving, failing = WarmUpPipeline(), WarmUpPipeline(RuntimeError("base failed to deploy"))
        models = {"tiny.en": Readiness.of_pipeline(serving), "base": Readiness.of_pipeline(failing)}
        first = models_readiness(models)  # starts both warm-ups; neither has gone through yet
        await asyncio.sleep(0.05)
        second = models_readiness(models)  # base's failed warm-up starts again; tiny.en's is done
        await asyncio.sleep(0.05)
        return first, second, serving, failing

    first, (ready, states), serving, failing = asyncio.run(probe_twice())
    assert first[0] is False and not any(state["ready"] for state in first[1].values())
    assert ready is False
    assert states["tiny.en"]["ready"] and states["tiny.en"]["warm_up_s"] >= 0
    assert states["base"] == {"ready": False, "last_error": "base failed to deploy"}
    assert serving.windows == 1 and failing.windows == 2, "a failed warm-up is tried again at the next probe"
    error = not_ready(states)
    assert (error.status, error.code, error.retry_after_s) == (503, "not_ready", 1)
    assert "of base yet (last warm-up: base: base failed to deploy). Ready: tiny.en." in error.message


def test_every_model_ready_makes_the_app_ready():
    async def probe_twice():
        models = {
            "tiny.en": Readiness.of_pipeline(WarmUpPipeline()),
            "base": Readiness.of_pipeline(WarmUpPipeline()),
        }
        models_readiness(models)
        await asyncio.sleep(0.05)
        return models_readiness(models)

    ready, states = asyncio.run(probe_twice())
    assert ready and all(state["ready"] for state in states.values())


class SilentPipeline:
    """A model whose deployment never answers: a call made before its handle knew the deployment
    failed to start waits for a replica forever."""

    def __init__(self):
        self.windows = 0

    async def decode_window(self, window_id, samples, options, priority) -> None:
        self.windows += 1
        await asyncio.Event().wait()


def test_a_warm_up_that_never_answers_is_given_up_and_the_next_probe_sends_a_fresh_one(monkeypatch):
    import deployments.http.readiness as readiness

    monkeypatch.setattr(readiness, "WARM_UP_TIMEOUT_S", 0.05)

    async def probe_twice():
        silent = SilentPipeline()
        models = {"base": Readiness.of_pipeline(silent)}
        models_readiness(models)
        await asyncio.sleep(0.2)
        states = models_readiness(models)[1]
        await asyncio.sleep(0.02)
        return states, silent.windows

    states, windows = asyncio.run(probe_twice())
    assert states["base"]["ready"] is False and "no answer within 0.05 s" in states["base"]["last_error"]
    assert windows == 2


class WarmUpDiarizer:
    """The diarizer as readiness sees it: a voice call answered (silence holds no voice) or failed."""

    def __init__(self, failure: Exception | None = None):
        self.failure = failure
        self.clips = 0

    async def voice_embedding(self, samples):
        self.clips += 1
        await asyncio.sleep(0)
        if self.failure is not None:
            raise self.failure
        return None


def test_a_diarizer_not_ready_holds_the_app_back_and_is_named_beside_the_ready_models():
    async def probe_twice():
        diarizer = Readiness.of_diarizer(WarmUpDiarizer(RuntimeError("no diarizer replica")))
        models = {"tiny.en": Readiness.of_pipeline(WarmUpPipeline())}
        models_readiness(models), diarizer.state()
        await asyncio.sleep(0.05)
        return models_readiness(models), diarizer.state()

    (models_ready, states), diarizer = asyncio.run(probe_twice())
    assert models_ready and diarizer == {"ready": False, "last_error": "no diarizer replica"}
    error = not_ready(states, diarizer)
    assert error.status == 503 and error.code == "not_ready"
    assert error.message == (
        "The server is warming up: no warm-up clip has come back from a diarizer replica yet "
        "(last warm-up: no diarizer replica). Ready: tiny.en."
    )


def test_a_diarizer_that_answers_a_warm_up_clip_is_ready():
    async def probe_twice():
        answering = WarmUpDiarizer()
        diarizer = Readiness.of_diarizer(answering)
        diarizer.state()
        await asyncio.sleep(0.05)
        return diarizer.state(), answering.clips

    state, clips = asyncio.run(probe_twice())
    assert state["ready"] and state["warm_up_s"] >= 0 and clips == 1
