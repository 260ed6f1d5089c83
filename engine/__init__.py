"""The engine's public API: what a program that transcribes with it needs, and nothing else.

    from engine import EngineConfig, Transcriber, DecodeOptions
    with Transcriber(EngineConfig(model="tiny.en")) as transcriber:
        print(transcriber.transcribe(["talk.flac"], DecodeOptions())[0].text)

Names are imported on first use, so ``import engine.types`` (what deployments need of the engine
on the HTTP side) does not load the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "EngineConfig": "engine.config",
    "DecodeOptions": "engine.types",
    "DecodeResult": "engine.types",
    "FallbackOptions": "engine.types",
    "Priority": "engine.types",
    "LoadedModel": "engine.model.loading",
    "load_model": "engine.model.loading",
    "EncoderRunner": "engine.encode.runner",
    "DecoderEngine": "engine.decode.engine",
    "Transcriber": "engine.transcribe.offline",
    "Transcription": "engine.transcribe.windows",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
