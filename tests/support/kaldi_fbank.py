"""Kaldi fbank as kaldi-native-fbank computes it (the library senko's C++ extractor is adapted from,
through 3D-Speaker's runtime), with senko's options: the reference for engine/diarize/fbank.py, and
senko's fbank step where its own binary cannot run.

senko's ``libfbank_extractor.so`` is built with AVX-512 instructions and dies with SIGILL on a CPU
without them. senko's pipeline stays the reference for diarization error either way: on such a CPU
only its fbank step is computed by kaldi-native-fbank instead, with the same options.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
_FRAME_SAMPLES = 400


def kaldi_fbank(samples: np.ndarray) -> np.ndarray:
    """One window's [frames, 80] log mel fbank, mean-normalized over the window, as senko's
    extractor computes it: a window shorter than one frame is zero-padded to one."""
    import kaldi_native_fbank as knf

    options = knf.FbankOptions()
    options.frame_opts.samp_freq = SAMPLE_RATE
    options.frame_opts.dither = 0.0
    options.frame_opts.window_type = "povey"
    options.frame_opts.preemph_coeff = 0.97
    options.frame_opts.remove_dc_offset = True
    options.frame_opts.round_to_power_of_two = True
    options.frame_opts.snip_edges = True
    options.mel_opts.num_bins = 80
    options.mel_opts.low_freq = 20.0
    options.mel_opts.high_freq = 0.0
    options.use_energy = False
    options.use_log_fbank = True
    options.use_power = True
    if len(samples) < _FRAME_SAMPLES:
        samples = np.pad(samples, (0, _FRAME_SAMPLES - len(samples)))
    fbank = knf.OnlineFbank(options)
    fbank.accept_waveform(SAMPLE_RATE, np.asarray(samples, dtype=np.float32).tolist())
    fbank.input_finished()
    frames = np.stack([fbank.get_frame(index) for index in range(fbank.num_frames_ready)])
    return (frames - frames.mean(axis=0)).astype(np.float32)


@functools.lru_cache(maxsize=1)
def senko_binary_runs_here() -> bool:
    """Whether this CPU has the AVX-512 subsets senko's fbank binary uses."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512f" in flags and "avx512bw" in flags


def _kaldi_fbank_features(self, audio_source, subsegments, *, sample_offset=0):
    """senko's ``_extract_fbank_features`` for samples in memory, by kaldi-native-fbank: the flat
    features, frames per subsegment, their offsets and the feature dimension, as senko returns them.
    Subsegments are (start_s, end_s) pairs; senko reads them as float32 seconds, as here."""
    seconds = np.asarray(subsegments, dtype=np.float32).reshape(-1, 2)
    windows = []
    for start_s, end_s in seconds:
        start = int(np.float32(start_s) * np.float32(SAMPLE_RATE))
        length = max(int(np.float32(end_s - start_s) * np.float32(SAMPLE_RATE)), 1)
        windows.append(kaldi_fbank(audio_source[start : start + length]))
    frames = np.array([len(window) for window in windows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(frames[:-1] * 80)]).astype(np.int64)
    flat = np.concatenate([window.reshape(-1) for window in windows]) if windows else np.zeros(0, np.float32)
    return flat, frames, offsets, 80


def runnable_senko(diarizer):
    """A senko ``Diarizer`` whose pipeline runs on this CPU: itself where its fbank binary runs,
    else the same object with its fbank step computed by kaldi-native-fbank."""
    if not senko_binary_runs_here():
        diarizer._extract_fbank_features = types.MethodType(_kaldi_fbank_features, diarizer)
    return diarizer
