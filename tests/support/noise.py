"""A noise set made in the tests: audio without speech (silence, white and pink noise, tones) and
silence or noise with speech clips inserted at known times."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.transcribe.evaluation import load_manifest
from tests.support.speech import SPEECH_DIR


@dataclass(frozen=True)
class NoiseClip:
    name: str
    samples: np.ndarray  # float32, 16 kHz
    speech_at_s: list[tuple[float, float]] = field(default_factory=list)  # inserted speech, in order
    speech_texts: list[str] = field(default_factory=list)


def white_noise(duration_s: float, rms: float, rng: np.random.Generator) -> np.ndarray:
    return (rms * rng.standard_normal(int(duration_s * SAMPLE_RATE))).astype(np.float32)


def pink_noise(duration_s: float, rms: float, rng: np.random.Generator) -> np.ndarray:
    """Noise whose power falls as 1/f, as rooms, fans and traffic sound."""
    length = int(duration_s * SAMPLE_RATE)
    spectrum = np.fft.rfft(rng.standard_normal(length))
    spectrum /= np.sqrt(np.maximum(np.arange(len(spectrum)), 1))
    noise = np.fft.irfft(spectrum, length)
    return (rms * noise / np.sqrt(np.mean(noise**2))).astype(np.float32)


def tone_sequence(duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Quarter-second tones at random pitches between 200 Hz and 2 kHz: a melody with no words."""
    tone_samples = SAMPLE_RATE // 4
    t = np.arange(tone_samples) / SAMPLE_RATE
    envelope = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    tones = [
        0.3 * envelope * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) for _ in range(int(duration_s * 4))
    ]
    return np.concatenate(tones).astype(np.float32)


def _speech_only(samples: np.ndarray) -> np.ndarray:
    """A clip without its leading and trailing quiet, so its place in a file is where speech is."""
    frame = SAMPLE_RATE // 100
    energy = np.sqrt(np.mean(samples[: len(samples) // frame * frame].reshape(-1, frame) ** 2, axis=1))
    loud = np.flatnonzero(energy > 0.05 * energy.max())
    return samples[loud[0] * frame : (loud[-1] + 1) * frame]


def with_speech(name: str, background: np.ndarray, inserts: list[tuple[str, float]]) -> NoiseClip:
    """``background`` with each (clip id, start s) speech clip added at its start."""
    clips = {clip.id: clip for clip in load_manifest(SPEECH_DIR)}
    audio = background.copy()
    spans, texts = [], []
    for clip_id, start_s in inserts:
        speech = _speech_only(load_audio_file(clips[clip_id].path))
        start = int(start_s * SAMPLE_RATE)
        audio[start : start + len(speech)] += speech
        spans.append((start_s, start_s + len(speech) / SAMPLE_RATE))
        texts.append(clips[clip_id].text)
    return NoiseClip(name, audio, spans, texts)


def noise_set(seed: int = 0) -> list[NoiseClip]:
    rng = np.random.default_rng(seed)
    return [
        NoiseClip("silence-60s", np.zeros(60 * SAMPLE_RATE, dtype=np.float32)),
        *(NoiseClip(f"white-noise-rms{rms:g}", white_noise(20, rms, rng)) for rms in (0.003, 0.03, 0.1)),
        *(NoiseClip(f"pink-noise-rms{rms:g}", pink_noise(20, rms, rng)) for rms in (0.01, 0.1)),
        NoiseClip("tone-sequence", tone_sequence(20, rng)),
        with_speech(
            "silence-with-speech",
            np.zeros(40 * SAMPLE_RATE, np.float32),
            [("osr72_01", 5.0), ("tts_05", 22.0)],
        ),
        with_speech("noise-with-speech", white_noise(40, 0.005, rng), [("osr72_02", 8.0), ("tts_07", 25.0)]),
    ]
