"""Engines built and run the way the tests need them: with config overrides, fed cross-attention
K/V computed from audio, and stepped until every request has finished."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from os import PathLike

import numpy as np
import torch

from engine.config import EngineConfig, GPUSwitches
from engine.decode.engine import DecoderEngine
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVTensor
from engine.model.loading import LoadedModel
from engine.types import DecodeOptions, DecodeResult
from tests.support.speech import windows_of

MAX_STEPS = 10_000  # far beyond any test's decode: more means a request hangs


def config_with(loaded: LoadedModel, **overrides) -> EngineConfig:
    """The loaded model's engine config with ``overrides``; a GPU switch (``async_steps``,
    ``stepped_prompt_tokens``, ...) is given by name and lands in the config's ``gpu`` section."""
    settings = loaded.config.model_dump()
    gpu = settings.pop("gpu") | {
        name: overrides.pop(name) for name in list(overrides) if name in GPUSwitches.model_fields
    }
    return EngineConfig(**{**settings, **overrides, "gpu": gpu})


def engine_with(loaded: LoadedModel, **overrides) -> DecoderEngine:
    """A decoder engine of the loaded model, its config with ``overrides``."""
    return DecoderEngine(loaded, config_with(loaded, **overrides))


def cross_kvs_of(
    model: LoadedModel | EncoderRunner, audio: Iterable[str | PathLike | np.ndarray]
) -> list[torch.Tensor]:
    """Each audio file's or sample array's first 30 s window encoded, as its cross-attention K/V
    [layers, 2, 1500, heads, head_dim] (one batch through the encoder)."""
    encoder = model if isinstance(model, EncoderRunner) else EncoderRunner(model)
    return list(encoder.cross_kv(encoder.encode(windows_of(audio))))


def cross_kv_of(model: LoadedModel | EncoderRunner, audio: str | PathLike | np.ndarray) -> torch.Tensor:
    """One audio file's or sample array's cross-attention K/V (see cross_kvs_of)."""
    return cross_kvs_of(model, [audio])[0]


def steps_to_completion(engine: DecoderEngine, max_steps: int = MAX_STEPS) -> Iterator[list[DecodeResult]]:
    """Step the engine while it has work, yielding each step's finished requests."""
    for _ in range(max_steps):
        if not engine.has_work:
            return
        yield engine.step()
    raise AssertionError("engine did not finish: a request hangs")


def run_to_completion(engine: DecoderEngine, max_steps: int = MAX_STEPS) -> list[DecodeResult]:
    """Every request's result, in the order they finish."""
    return [result for finished in steps_to_completion(engine, max_steps) for result in finished]


def run_to_completion_by_id(engine: DecoderEngine, max_steps: int = MAX_STEPS) -> dict[str, DecodeResult]:
    """Every request's result, by request id."""
    return {result.request_id: result for result in run_to_completion(engine, max_steps)}


def decode_one(engine: DecoderEngine, source, options: DecodeOptions):
    """Submit one request reading its cross-attention K/V from ``source`` and run the engine until it
    has finished: (the request, its result)."""
    request = engine.make_request(options, source)
    engine.submit(request)
    results = run_to_completion(engine)
    assert len(results) == 1
    return request, results[0]


def decode_alone(engine: DecoderEngine, cross_kv: torch.Tensor, options: DecodeOptions):
    """decode_one from a K/V tensor, on an engine that then holds no block."""
    request, result = decode_one(engine, CrossKVTensor(cross_kv), options)
    assert engine.pool.num_used_blocks == 0
    return request, result
