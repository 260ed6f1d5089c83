"""Audio front end: encoded bytes -> float32 mono 16 kHz samples -> batched log-mel spectrogram.

The mel computation follows Whisper's recipe (periodic Hann window of 400 samples, hop 160, power
spectrum, Slaney mel filters up to 8 kHz, log10 with a dynamic range of 8, scaled by (x + 4) / 4) so
that it matches transformers' ``WhisperFeatureExtractor`` and the weights trained on it.
"""

from __future__ import annotations

import functools
import io
import math
import os

import numpy as np
import soundfile
import torch

from engine.errors import AudioDecodeError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH_S = 30
N_SAMPLES = CHUNK_LENGTH_S * SAMPLE_RATE  # 480000 samples in one encoder window


def decode_audio(data: bytes) -> np.ndarray:
    """Any format libsndfile reads (wav, flac, ogg, mp3, ...) -> float32 mono samples at 16 kHz.

    Raises AudioDecodeError for empty input, bytes that are not audio, or non-finite samples; an
    audio file with zero frames is valid and gives an empty array.
    """
    if not data:
        raise AudioDecodeError("the audio file is empty")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise AudioDecodeError(f"could not decode audio: {error}") from None
    return _to_model_input(samples, rate)


def load_audio_file(path: str | os.PathLike) -> np.ndarray:
    try:
        with open(path, "rb") as audio_file:
            data = audio_file.read()
    except OSError as error:
        raise AudioDecodeError(f"could not read {os.fspath(path)!r}: {error.strerror}") from None
    try:
        return decode_audio(data)
    except AudioDecodeError as error:
        raise AudioDecodeError(f"{os.fspath(path)}: {error}") from None


def _to_model_input(samples: np.ndarray, rate: int) -> np.ndarray:
    """[frames, channels] at any rate -> [frames'] mono at 16 kHz."""
    if samples.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise AudioDecodeError("the audio contains NaN or infinite samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    return resample(mono, rate, SAMPLE_RATE)


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited (windowed-sinc, Hann) polyphase resampling, as torchaudio's default does.

    The filter's cutoff sits just under the lower Nyquist frequency so that downsampling from 44.1
    or 48 kHz does not alias speech harmonics into the band the mel filters look at.
    """
    if orig_rate == new_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    divisor = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // divisor, new_rate // divisor
    kernel, width = _sinc_kernel(orig, new)
    waveform = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    length = waveform.shape[0]
    padded = torch.nn.functional.pad(waveform[None, None], (width, width + orig))
    # Each of the `new` output phases is a strided convolution with its own shifted kernel.
    phases = torch.nn.functional.conv1d(padded, kernel, stride=orig)  # [1, new, frames]
    output = phases[0].transpose(0, 1).reshape(-1)
    target_length = math.ceil(new * length / orig)
    return output[:target_length].numpy().astype(np.float32, copy=False)


@functools.lru_cache(maxsize=16)
def _sinc_kernel(
    orig: int, new: int, zero_crossings: int = 6, rolloff: float = 0.99
) -> tuple[torch.Tensor, int]:
    base_rate = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base_rate)
    positions = torch.arange(-width, width + orig, dtype=torch.float64)[None, :] / orig
    positions = positions + (torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new)
    positions = positions * base_rate
    positions = positions.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(positions * math.pi / zero_crossings / 2) ** 2
    positions = positions * math.pi
    sinc = torch.where(positions == 0, torch.ones_like(positions), torch.sin(positions) / positions)
    kernel = (sinc * window * base_rate / orig).to(torch.float32)
    return kernel[:, None, :], width


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
