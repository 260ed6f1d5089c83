"""Accuracy of each precision path the engine offers on a GPU, on real weights: greedy tokens
against the CPU's fp32 run of the same weights, and WER, over the speech set (tests/data/speech).
tests/engine/test_gpu_real_weights.py holds each path to its bounds with these.

Every 30 s window is decoded through ``Transcriber.run_windows`` (continuous batching, the GPU
switches as configured), greedy, no timestamps, no fallback, so a difference is the arithmetic's
and nothing else's. English clips decode with language "en"; on a multilingual model the
multilingual clip's two windows (English, then German) detect their language.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from engine.config import EngineConfig
from engine.model.audio import SAMPLE_RATE
from engine.transcribe.evaluation import load_manifest, word_error_rate
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions
from tests.support.speech import SPEECH_DIR

WINDOW_SAMPLES = 30 * SAMPLE_RATE

# The precision paths the engine offers on a GPU: EngineConfig fields over device="cuda".
GPU_PATHS: dict[str, dict] = {
    "fp32": dict(dtype="float32"),
    "fp16 (default)": dict(dtype="auto"),
    "bf16": dict(dtype="bfloat16"),
    "fp16 + fp8 KV": dict(dtype="float16", kv_cache_dtype="fp8_e4m3"),
    "bf16 + fp8 KV": dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
    "fp16 + FP8 encoder": dict(dtype="float16", gpu={"fp8_encoder": True}),
}


@dataclass(frozen=True)
class SpeechWindow:
    clip_id: str
    samples: np.ndarray
    language: str | None  # None: detected


@dataclass(frozen=True)
class PathResult:
    path: str
    windows: int
    tokens_equal: int  # windows whose tokens equal the reference run's
    wer: float  # over the English clips, a long clip's windows joined
    languages: tuple[str, ...]  # of the detected windows


@lru_cache(maxsize=1)
def _clip_samples() -> dict[str, np.ndarray]:
    """The speech set's samples. soundfile reads them (16 kHz mono FLAC, decoded to the same samples
    as the server's FFmpeg path), so this runs where PyAV is not installed."""
    import soundfile

    samples = {}
    for clip in load_manifest(SPEECH_DIR):
        audio, rate = soundfile.read(clip.path, dtype="float32")
        assert rate == SAMPLE_RATE and audio.ndim == 1, clip.id
        samples[clip.id] = audio
    return samples


def speech_set_windows(multilingual: bool) -> list[SpeechWindow]:
    """30 s windows of every English clip with a reference, and of the multilingual clip on a
    multilingual model; a clip longer than 30 s is cut at 30 s boundaries."""
    windows = []
    for clip in load_manifest(SPEECH_DIR):
        if not clip.text and not (multilingual and clip.id == "multilingual"):
            continue
        audio = _clip_samples()[clip.id]
        for start in range(0, len(audio), WINDOW_SAMPLES):
            language = "en" if clip.text else None
            windows.append(SpeechWindow(clip.id, audio[start : start + WINDOW_SAMPLES], language))
    return windows


def decode_speech_set(
    config: EngineConfig, beam_size: int = 1
) -> tuple[list[list[int]], list[SpeechWindow], list]:
    """Tokens of every window of the speech set under ``config`` (greedy, or a beam search of
    ``beam_size``), with the windows and results."""
    # Each config compiles its own encoder: without a reset, torch.compile stops recompiling
    # after a few dtypes in one process and runs the rest eagerly.
    torch._dynamo.reset()
    with Transcriber(config, encoder_batch_size=16) as transcriber:
        windows = speech_set_windows(transcriber.loaded.weights.dims.is_multilingual)
        results = transcriber.run_windows(
            deque(
                (key, window.samples, DecodeOptions(language=window.language, beam_size=beam_size))
                for key, window in enumerate(windows)
            )
        )
    ordered = [results[key][0] for key in range(len(windows))]
    return [result.tokens for result in ordered], windows, ordered


def english_wer(windows: list[SpeechWindow], results: list) -> float:
    references = {clip.id: clip.text for clip in load_manifest(SPEECH_DIR) if clip.text}
    texts: dict[str, list[str]] = {}
    for window, result in zip(windows, results):
        if window.clip_id in references:
            texts.setdefault(window.clip_id, []).append(result.text)
    ids = list(texts)
    return word_error_rate([references[i] for i in ids], [" ".join(texts[i]) for i in ids])


def measure(
    path: str, config: EngineConfig, reference: list[list[int]] | None, beam_size: int = 1
) -> tuple[PathResult, list[list[int]]]:
    """The path's result against ``reference`` tokens (None: it is the reference), and its tokens."""
    tokens, windows, results = decode_speech_set(config, beam_size)
    equal = len(tokens) if reference is None else sum(a == b for a, b in zip(tokens, reference, strict=True))
    languages = tuple(r.language for w, r in zip(windows, results) if w.language is None)
    return PathResult(path, len(windows), equal, english_wer(windows, results), languages), tokens


def cpu_reference(model: str, beam_size: int = 1) -> tuple[list[list[int]], PathResult]:
    """The tokens every GPU path is compared with, and their WER."""
    config = EngineConfig(
        model=model, device="cpu", dtype="float32", max_num_seqs=64, kv_cache_memory_mb=2048
    )
    result, tokens = measure("CPU fp32 (reference)", config, reference=None, beam_size=beam_size)
    return tokens, result


def gpu_config(model: str, fields: dict) -> EngineConfig:
    return EngineConfig(model=model, device="cuda", max_num_seqs=64, kv_cache_memory_mb=4096, **fields)
