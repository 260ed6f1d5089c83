"""The speech set carried in tests/data/speech, and 30 s windows of it."""

from __future__ import annotations

from collections.abc import Iterable
from os import PathLike

import numpy as np
import torch

from engine.model.audio import load_audio_file, pad_or_trim
from engine.transcribe.evaluation import SpeechClip, load_manifest
from tests.support.paths import REPO_ROOT

SPEECH_DIR = REPO_ROOT / "tests" / "data" / "speech"


def english_clips() -> list[SpeechClip]:
    """Every clip with a reference transcript (42 English clips, one of them long-form)."""
    return [clip for clip in load_manifest(SPEECH_DIR) if clip.text]


def short_english_clips() -> list[SpeechClip]:
    """The English clips that fit one 30 s window."""
    return [clip for clip in english_clips() if clip.duration_s <= 30]


def windows_of(audio: Iterable[str | PathLike | np.ndarray]) -> torch.Tensor:
    """Audio files or samples, each padded or trimmed to one 30 s window: [N, 480000] float32."""
    samples = [item if isinstance(item, np.ndarray) else load_audio_file(item) for item in audio]
    return torch.from_numpy(np.stack([pad_or_trim(window) for window in samples]))
