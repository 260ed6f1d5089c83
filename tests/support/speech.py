"""The speech set carried in tests/data/speech, and 30 s windows of it."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterable
from os import PathLike

import numpy as np
import soundfile
import torch

from engine.model.audio import SAMPLE_RATE, load_audio_file, pad_or_trim
from engine.transcribe.evaluation import SpeechClip, clip_samples, load_manifest
from tests.support.paths import REPO_ROOT, SPEECH_DIR

BROAD_SPEECH_DIR = REPO_ROOT / "tests" / "data" / "broad_speech"
SPLITS = ("tuning", "held_out")


def english_clips() -> list[SpeechClip]:
    """Every clip with a reference transcript (42 English clips, one of them long-form)."""
    return [clip for clip in load_manifest(SPEECH_DIR) if clip.text]


def broad_clips(split: str | None = None) -> list[SpeechClip]:
    """The broad speech set: the English clips above and tests/data/broad_speech's synthetic
    utterances (benchmarks/broad_speech_clips.py), all of them or one split. Every third English
    clip is held out, as a third of the synthetic voices are."""
    if split not in (None, *SPLITS):
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    real = [
        dataclasses.replace(clip, split=SPLITS[index % 3 == 2]) for index, clip in enumerate(english_clips())
    ]
    clips = real + load_manifest(BROAD_SPEECH_DIR)
    return [clip for clip in clips if split is None or clip.split == split]


def sample_of(clips: list[SpeechClip], count: int) -> list[SpeechClip]:
    """``count`` clips spread evenly over ``clips`` (the same ones on every run)."""
    step = len(clips) / count
    return [clips[int(index * step)] for index in range(count)]


def samples_of(clips: Iterable[SpeechClip]) -> list[np.ndarray]:
    """Each clip's samples as it is scored: with the noise its manifest names."""
    return [clip_samples(clip) for clip in clips]


def short_english_clips() -> list[SpeechClip]:
    """The English clips that fit one 30 s window."""
    return [clip for clip in english_clips() if clip.duration_s <= 30]


def windows_of(audio: Iterable[str | PathLike | np.ndarray]) -> torch.Tensor:
    """Audio files or samples, each padded or trimmed to one 30 s window: [N, 480000] float32."""
    samples = [item if isinstance(item, np.ndarray) else load_audio_file(item) for item in audio]
    return torch.from_numpy(np.stack([pad_or_trim(window) for window in samples]))


def wav_bytes(samples: np.ndarray) -> bytes:
    """16 kHz float samples as the bytes of a 16-bit WAV file, as a client uploads them."""
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def speech_tape(duration_s: float, pause_s: float = 0.3) -> np.ndarray:
    """The speech set's clips up to 30 s back to back with pauses, over and over until at least
    ``duration_s``: 16 kHz samples to cut files of any length from."""
    clips = [load_audio_file(clip.path) for clip in short_english_clips()]
    pause = np.zeros(int(pause_s * SAMPLE_RATE), dtype=np.float32)
    pieces, total = [], 0
    while total < duration_s * SAMPLE_RATE:
        for audio in clips:
            pieces += [audio, pause]
            total += len(audio) + len(pause)
            if total >= duration_s * SAMPLE_RATE:
                break
    return np.concatenate(pieces)


def dense_speech_file(duration_s: float = 85.0) -> bytes:
    """The speech set's clips back to back with 0.3 s pauses: ~duration_s of continuous speech."""
    return wav_bytes(speech_tape(duration_s))
