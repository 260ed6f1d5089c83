"""Encoder states remembered by window, for transcribers that share one encoder: variants that
change only the decoding (beam search, the KV cache's dtype) decode the states the first transcriber's
encoder gave, instead of encoding the same windows again.

On the CPU the encoder gives a window the same states, bit for bit, alone or in any batch, so a
window's states do not depend on which batch first encoded it: each variant's decoder gets exactly
what its own encoder would have given it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.encode.runner import EncoderRunner
from engine.model.audio import load_audio_file
from engine.model.loading import LoadedModel
from engine.transcribe.offline import Transcriber
from tests.support.speech import short_english_clips


def window_key(samples: np.ndarray) -> str:
    """A window's samples as the encoder is given them (before padding to 30 s)."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    return f"{len(samples)}-{hashlib.sha256(samples).hexdigest()}"


class RememberedStates:
    """Encoder states [frames, d_model] of full 30 s windows, by the window's samples."""

    def __init__(self):
        self.by_window: dict[str, torch.Tensor] = {}
        self.encoded = 0  # windows encoded since, not found here

    def add(self, windows: Sequence[np.ndarray], states: Sequence[torch.Tensor]) -> None:
        """Windows' states the same encoder computed elsewhere (say, once per test run)."""
        for samples, window_states in zip(windows, states, strict=True):
            self.by_window[window_key(samples)] = window_states

    def states_of(
        self, windows: Sequence[np.ndarray], encode: Callable[[list[np.ndarray]], torch.Tensor]
    ) -> torch.Tensor:
        """The windows' states [N, frames, d_model], ``encode`` (an EncoderRunner's) encoding in one
        batch only those not remembered here, which are remembered from then on. Its model must be
        the one these states came from."""
        keys = [window_key(samples) for samples in windows]
        missing = [index for index, key in enumerate(keys) if key not in self.by_window]
        if missing:
            states = encode([windows[index] for index in missing])
            for index, window_states in zip(missing, states):
                self.by_window[keys[index]] = window_states
            self.encoded += len(missing)
        return torch.stack([self.by_window[key] for key in keys])

    def given_to(self, transcriber: Transcriber) -> Transcriber:
        """The transcriber, its encoder's full windows now taken from here (states_of)."""
        runner = transcriber.encoder.runner
        encode = runner.encode

        def encode_once(windows, frames: int | None = None) -> torch.Tensor:
            if frames is not None or isinstance(windows, torch.Tensor):
                return encode(windows, frames)
            return self.states_of(windows, encode)

        runner.encode = encode_once
        return transcriber


def remembering_the_speech_set(
    tiny_en: LoadedModel, speech_set_states: Sequence[torch.Tensor]
) -> RememberedStates:
    """Remembered states holding tests/conftest.py's speech_set_states: tiny_en's states of each
    short English clip's window, encoded alone, which the run computes once for every module.
    Checked first: two of those windows encoded in one batch give the same states."""
    windows = [load_audio_file(clip.path) for clip in short_english_clips()]
    batch = EncoderRunner(tiny_en).encode(windows[:2])
    assert all(map(torch.equal, batch, speech_set_states[:2])), (
        "the CPU encoder's states of a window depend on its batch: transcribers cannot share them"
    )
    states = RememberedStates()
    states.add(windows, speech_set_states)
    return states
