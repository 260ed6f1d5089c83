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
    "WindowTimeline": "engine.transcribe.windows",
    # What the serving side (deployments/) needs of the engine beyond the above, so that it reaches
    # the engine through this module only (tests/deployments/test_engine_boundary.py).
    "SAMPLE_RATE": "engine.model.audio",
    "N_SAMPLES": "engine.model.audio",
    "CHUNK_LENGTH_S": "engine.model.audio",
    "decode_audio": "engine.model.audio",
    "DecodeProcesses": "engine.model.decode_processes",
    "resample": "engine.model.audio",
    "g711_to_float": "engine.model.audio",
    "pcm16_to_float": "engine.model.audio",
    "StreamResampler": "engine.model.ffmpeg",
    "load_silero_vad": "engine.model.vad",
    "ModelDims": "engine.model.weights",
    "OverlappedEncoder": "engine.encode.overlap",
    "context_frames": "engine.encode.context",
    "context_buckets": "engine.encode.context",
    "EngineStats": "engine.decode.engine",
    "LoopTimings": "engine.decode.timings",
    "freeze_start_up_objects": "engine.decode.heap",
    "compression_ratio": "engine.decode.fallback",
    "CrossKVSource": "engine.kv.sources",
    "EncoderStates": "engine.kv.sources",
    "SpeechOptions": "engine.transcribe.speech",
    "detect_speech": "engine.transcribe.speech",
    "speech_probabilities": "engine.transcribe.speech",
    "speech_regions": "engine.transcribe.speech",
    "speech_windows": "engine.transcribe.speech",
    "AudioWindow": "engine.transcribe.windows",
    "LongFormCursor": "engine.transcribe.windows",
    "LongFormMode": "engine.transcribe.windows",
    "PendingWindow": "engine.transcribe.windows",
    "long_form_cursor": "engine.transcribe.windows",
    "split_windows": "engine.transcribe.windows",
    "LocalAgreement": "engine.transcribe.agreement",
    "SpeechStarted": "engine.transcribe.turn_detection",
    "IdleTimedOut": "engine.transcribe.turn_detection",
    "TurnEvent": "engine.transcribe.turn_detection",
    "TurnDetector": "engine.transcribe.turn_detection",
    "Diarizer": "engine.diarize.pipeline",
    "SpeakerEncoderOptions": "engine.diarize.embeddings",
    "DiarizationRequest": "engine.diarize.types",
    "Diarization": "engine.diarize.types",
    "SpeakerTurn": "engine.diarize.types",
    "SpeakerSegment": "engine.diarize.assignment",
    "split_by_speaker": "engine.diarize.assignment",
    "speaker_at": "engine.diarize.assignment",
    "match_known_speakers": "engine.diarize.known_speakers",
    "cosine_similarity": "engine.diarize.similarity",
    "SESSION_TURN_THRESHOLD": "engine.diarize.similarity",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
