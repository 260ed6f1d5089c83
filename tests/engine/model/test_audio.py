"""The audio front end reads what users upload and computes the mels the weights were trained on."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch
from transformers import WhisperFeatureExtractor

from engine.errors import AudioDecodeError
from engine.model.audio import (
    N_SAMPLES,
    SAMPLE_RATE,
    decode_audio,
    g711_to_float,
    load_audio_file,
    log_mel_spectrogram,
    pad_or_trim,
    pcm16_to_float,
    resample,
)
from tests.support.speech import english_clips


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


@pytest.mark.parametrize("n_mels", [80, 128])
def test_batched_log_mel_matches_transformers_feature_extractor_on_the_speech_set(n_mels):
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    clips = english_clips()
    samples = [load_audio_file(clip.path) for clip in clips]
    batch = torch.from_numpy(np.stack([pad_or_trim(s) for s in samples]))
    ours = log_mel_spectrogram(batch, n_mels).numpy()
    assert ours.shape == (len(clips), n_mels, 3000)
    for index, audio in enumerate(samples):
        reference = extractor(
            audio[:N_SAMPLES], sampling_rate=SAMPLE_RATE, return_tensors="np"
        ).input_features[0]
        assert np.abs(ours[index] - reference).max() <= 1e-3, clips[index].id


@pytest.mark.parametrize(
    "rate, frequency_hz", [(8000, 300.0), (22050, 1000.0), (44100, 440.0), (48000, 2500.0)]
)
def test_resampling_to_16k_keeps_a_tone_and_its_duration(rate, frequency_hz):
    tone = np.sin(2 * np.pi * frequency_hz * np.arange(rate) / rate).astype(np.float32)
    converted = resample(tone, rate, SAMPLE_RATE)
    expected = np.sin(2 * np.pi * frequency_hz * np.arange(SAMPLE_RATE) / SAMPLE_RATE)
    assert converted.shape == (SAMPLE_RATE,)
    assert np.abs(converted[400:-400] - expected[400:-400]).max() < 5e-3


def test_downsampling_removes_frequencies_above_the_new_nyquist():
    rate = 48000
    tone = np.sin(2 * np.pi * 12000.0 * np.arange(rate) / rate).astype(np.float32)
    assert np.abs(resample(tone, rate, SAMPLE_RATE)[400:-400]).max() < 0.01


@pytest.mark.parametrize(
    "fmt, subtype, rate, channels",
    [
        ("WAV", "PCM_16", 16000, 1),
        ("WAV", "PCM_24", 44100, 2),
        ("WAV", "FLOAT", 8000, 1),
        ("FLAC", "PCM_16", 48000, 2),
        ("OGG", "VORBIS", 16000, 1),
        ("MP3", "MPEG_LAYER_III", 44100, 1),
    ],
)
def test_common_formats_rates_and_channel_counts_decode_to_16k_mono(fmt, subtype, rate, channels):
    duration_s = 1.5
    t = np.arange(int(rate * duration_s)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    samples = np.stack([tone] * channels, axis=1) if channels > 1 else tone
    decoded = decode_audio(encode(samples, rate, fmt, subtype))
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    # Lossy codecs add encoder delay and padding; allow 0.1 s.
    assert abs(len(decoded) / SAMPLE_RATE - duration_s) < 0.1
    rms = float(np.sqrt(np.mean(decoded[1600:-1600] ** 2)))
    assert abs(rms - 0.5 / np.sqrt(2)) < 0.05


def test_stereo_is_mixed_down_to_the_mean_of_its_channels():
    left = np.full(16000, 0.5, dtype=np.float32)
    right = np.zeros(16000, dtype=np.float32)
    decoded = decode_audio(encode(np.stack([left, right], axis=1), SAMPLE_RATE, "WAV", "FLOAT"))
    assert np.allclose(decoded, 0.25)


def test_a_wav_with_no_frames_is_valid_and_empty():
    assert decode_audio(encode(np.zeros(0, dtype=np.float32), SAMPLE_RATE, "WAV", "PCM_16")).shape == (0,)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"this is a text file, not audio\n" * 20, "could not decode"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "could not decode"),  # a wav header cut short
        (b"fLaC\x00\x00\x00\x22" + b"\x00" * 10, "could not decode"),  # a corrupt flac header
        (b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\xff" * 7, "could not decode"),  # a corrupt mp3
    ],
)
def test_bytes_that_are_not_audio_raise_audio_decode_error(data, message):
    with pytest.raises(AudioDecodeError, match=message):
        decode_audio(data)


def test_non_finite_samples_raise_audio_decode_error():
    samples = np.zeros(1600, dtype=np.float32)
    samples[100] = np.nan
    with pytest.raises(AudioDecodeError, match="NaN or infinite"):
        decode_audio(encode(samples, SAMPLE_RATE, "WAV", "FLOAT"))


def test_a_missing_file_raises_audio_decode_error_naming_it(tmp_path):
    with pytest.raises(AudioDecodeError, match="nowhere.wav"):
        load_audio_file(tmp_path / "nowhere.wav")


@pytest.mark.parametrize("law, subtype", [("ulaw", "ULAW"), ("alaw", "ALAW")])
def test_g711_bytes_decode_as_libsndfile_decodes_them(law, subtype):
    speech = resample(load_audio_file(english_clips()[0].path), SAMPLE_RATE, 8000)
    wav = encode(speech, 8000, "WAV", subtype)
    raw = encode(speech, 8000, "RAW", subtype)  # the bare G.711 bytes a telephony client sends
    reference, _ = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert np.array_equal(g711_to_float(raw, law), reference)


def test_pcm16_bytes_decode_to_floats_and_an_odd_byte_count_is_refused():
    samples = np.array([0, 16384, -32768, 32767], dtype="<i2")
    assert pcm16_to_float(samples.tobytes()).tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    with pytest.raises(AudioDecodeError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")
