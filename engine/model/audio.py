"""Audio front end: float32 mono 16 kHz samples (decoded by engine/model/ffmpeg.py) -> batched
log-mel spectrogram.

The mel computation follows Whisper's recipe (periodic Hann window of 400 samples, hop 160, power
spectrum, Slaney mel filters up to 8 kHz, log10 with a dynamic range of 8, scaled by (x + 4) / 4) so
that it matches transformers' ``WhisperFeatureExtractor`` and the weights trained on it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

# Decoding lives with FFmpeg in engine/model/ffmpeg.py; these names are the front end's public API.
from engine.errors import AudioDecodeError
from engine.model.ffmpeg import SAMPLE_RATE, decode_audio, load_audio_file, resample

__all__ = ["SAMPLE_RATE", "decode_audio", "load_audio_file", "resample", "log_mel_spectrogram", "pad_or_trim"]

N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH_S = 30
N_SAMPLES = CHUNK_LENGTH_S * SAMPLE_RATE  # 480000 samples in one encoder window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 log-mel frames in one window


def pad_or_trim(samples: np.ndarray, length: int = N_SAMPLES) -> np.ndarray:
    if samples.shape[-1] >= length:
        return samples[..., :length]
    return np.pad(samples, [(0, 0)] * (samples.ndim - 1) + [(0, length - samples.shape[-1])])


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int, device: torch.device) -> torch.Tensor:
    """Slaney-scale, Slaney-normalized triangular filters [n_mels, N_FFT // 2 + 1] from 0 to 8 kHz."""
    n_freqs = N_FFT // 2 + 1
    fft_freqs = np.linspace(0, SAMPLE_RATE / 2, n_freqs)
    mel_points = np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), n_mels + 2)
    hz_points = _mel_to_hz(mel_points)
    # Triangles rising from hz_points[i] to hz_points[i + 1] and falling to hz_points[i + 2].
    slopes = hz_points[None, :] - fft_freqs[:, None]  # [n_freqs, n_mels + 2]
    gaps = np.diff(hz_points)
    rising = -slopes[:, :-2] / gaps[:-1]
    falling = slopes[:, 2:] / gaps[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))  # [n_freqs, n_mels]
    filters *= 2.0 / (hz_points[2:] - hz_points[:-2])  # equal area per filter ("slaney" norm)
    return torch.from_numpy(filters.T.astype(np.float32)).to(device)


_MEL_LINEAR_END_HZ = 1000.0
_MEL_LINEAR_END = 15.0  # 1000 Hz on the Slaney mel scale: linear below, logarithmic above
_MEL_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: float | np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    linear = 3.0 * hz / 200.0
    logarithmic = _MEL_LINEAR_END + np.log(np.maximum(hz, 1e-10) / _MEL_LINEAR_END_HZ) / _MEL_LOG_STEP
    return np.where(hz >= _MEL_LINEAR_END_HZ, logarithmic, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = 200.0 * mel / 3.0
    logarithmic = _MEL_LINEAR_END_HZ * np.exp(_MEL_LOG_STEP * (mel - _MEL_LINEAR_END))
    return np.where(mel >= _MEL_LINEAR_END, logarithmic, linear)


def log_mel_spectrogram(samples: torch.Tensor, n_mels: int) -> torch.Tensor:
    """[N, n_samples] float32 (on the model's device) -> [N, n_mels, n_samples // HOP_LENGTH]."""
    window = torch.hann_window(N_FFT, device=samples.device)
    stft = torch.stft(samples.float(), N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # Whisper drops the last frame: 3000 frames per 30 s
    mel = mel_filters(n_mels, samples.device) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    # Each window's dynamic range is limited to 8 (80 dB) below its own peak.
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian signed 16-bit PCM (OpenAI's realtime `pcm16`) -> float32 in [-1, 1)."""
    if len(data) % 2:
        raise AudioDecodeError(f"pcm16 audio needs an even number of bytes; got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def _g711_ulaw_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF  # µ-law bytes are sent inverted
    exponent, mantissa = (codes >> 4) & 0x07, codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32) / 32768.0


def _g711_alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55  # A-law inverts every other bit
    exponent, mantissa = (codes >> 4) & 0x07, codes & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1))
    return np.where(codes & 0x80, magnitude, -magnitude).astype(np.float32) / 32768.0


# ITU-T G.711 expansion, one table per law: 8-bit codes -> linear samples (8 kHz telephone audio).
G711_TABLES = {"ulaw": _g711_ulaw_table(), "alaw": _g711_alaw_table()}


def g711_to_float(data: bytes, law: str) -> np.ndarray:
    """G.711 µ-law (`ulaw`) or A-law (`alaw`) bytes -> float32 samples at their own rate (8 kHz)."""
    return G711_TABLES[law][np.frombuffer(data, dtype=np.uint8)]
