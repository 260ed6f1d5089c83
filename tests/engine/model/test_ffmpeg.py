"""FFmpeg (through PyAV) decodes every format OpenAI's API accepts, resamples without moving the
log-mel, and refuses broken or overlong files in words, early."""

from __future__ import annotations

import struct

import av
import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from engine.errors import AudioDecodeError, AudioTooLongError
from engine.model.audio import (
    SAMPLE_RATE,
    decode_audio,
    load_audio_file,
    log_mel_spectrogram,
    pad_or_trim,
    resample,
)
from engine.model.ffmpeg import StreamResampler
from tests.support.encoding import (
    MANY_CHANNEL_UPLOADS,
    UPLOAD_FORMATS,
    UploadFormat,
    encode,
    encode_channels,
    flac_claiming,
    video_only_mp4,
    zip_archive,
)
from tests.support.speech import SPEECH_DIR


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    return load_audio_file(SPEECH_DIR / "jfk.flac")


def _aligned_correlation(reference: np.ndarray, decoded: np.ndarray, max_lag: int = 2000) -> float:
    """The correlation at the best lag up to ``max_lag`` samples: AAC and MPEG audio start after
    their encoder's priming delay."""
    length = len(reference) - max_lag
    size = 1 << int(np.ceil(np.log2(len(reference) + len(decoded))))
    cross = np.fft.irfft(np.fft.rfft(decoded, size) * np.conj(np.fft.rfft(reference[:length], size)), size)
    lag = int(np.argmax(cross[:max_lag]))
    return float(np.corrcoef(reference[:length], decoded[lag : lag + length])[0, 1])


@pytest.mark.parametrize("upload", UPLOAD_FORMATS, ids=lambda upload: upload.name)
def test_every_upload_format_decodes_to_the_same_16k_mono_speech(upload: UploadFormat, jfk):
    decoded = decode_audio(encode(jfk, upload))
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert abs(len(decoded) - len(jfk)) / SAMPLE_RATE < 0.1  # encoder delay and padding
    assert _aligned_correlation(jfk, decoded) > 0.9


@pytest.mark.parametrize("rate", [44100, 48000])
def test_resampled_audio_keeps_the_log_mel_of_transformers_feature_extractor(rate, jfk):
    # Band-limited upsampling by zero-padding the spectrum: exact, so what the round trip moves
    # is FFmpeg's resampler's doing.
    length = len(jfk) * rate // SAMPLE_RATE
    spectrum = np.zeros(length // 2 + 1, dtype=complex)
    spectrum[: len(jfk) // 2 + 1] = np.fft.rfft(jfk.astype(np.float64))
    upsampled = (np.fft.irfft(spectrum, length) * length / len(jfk)).astype(np.float32)
    decoded = decode_audio(
        encode(upsampled / 1.01, UploadFormat("wav", "wav", "wav", "pcm_f32le", "flt", rate), rate)
    )
    assert len(decoded) == len(jfk)
    reference = WhisperFeatureExtractor(feature_size=80)(
        jfk / 1.01, sampling_rate=SAMPLE_RATE, return_tensors="np"
    ).input_features[0]
    ours = log_mel_spectrogram(torch.from_numpy(pad_or_trim(decoded))[None], 80)[0].numpy()
    difference = np.abs(ours - reference)
    # The hand-written polyphase resampler it replaced gave a mean of 8e-5 here; FFmpeg's 1e-5.
    assert difference.mean() < 5e-5
    assert np.quantile(difference, 0.999) < 0.05


def test_a_truncated_mp4_is_refused_in_words(jfk):
    mp4 = encode(jfk, UploadFormat("mp4", "mp4", "mp4", "aac", "fltp", 48000))
    with pytest.raises(AudioDecodeError, match="truncated, corrupt") as refused:
        decode_audio(mp4[: len(mp4) // 2])
    assert "<" not in str(refused.value) and "BytesIO" not in str(refused.value)


def test_an_mp4_with_no_audio_stream_is_refused_naming_what_it_holds():
    with pytest.raises(AudioDecodeError, match="no audio stream \\(it holds video only\\)"):
        decode_audio(video_only_mp4())


def test_a_zip_archive_is_refused_in_words():
    with pytest.raises(AudioDecodeError, match="could not decode audio: the file is truncated"):
        decode_audio(zip_archive())


def test_a_header_claiming_10_hours_is_refused_before_decoding(jfk):
    with pytest.raises(AudioTooLongError, match="header says it holds 36000 s") as refused:
        decode_audio(flac_claiming(10 * 3600 * SAMPLE_RATE, jfk), max_duration_s=3600)
    assert refused.value.claimed


def test_audio_past_the_limit_is_refused_while_decoding_when_the_header_does_not_say(jfk):
    with pytest.raises(AudioTooLongError, match="runs past 5 s") as refused:
        decode_audio(flac_claiming(0, jfk), max_duration_s=5)
    assert not refused.value.claimed
    assert len(decode_audio(flac_claiming(0, jfk), max_duration_s=60)) == len(jfk)


def test_a_stream_fed_in_chunks_of_any_length_resamples_as_the_whole_array():
    """A live client's chunks may be shorter than the resampler's filter (swr alone gives nothing
    back for those); one resampler per stream keeps its state, so no sample is lost or doubled."""
    samples = (np.sin(np.arange(48_000) * 0.013) * 0.3).astype(np.float32)
    stream = StreamResampler(24_000, SAMPLE_RATE)
    chunk_sizes = [1, 7, 33, 960, 2]
    pieces, start, index = [], 0, 0
    while start < samples.size:
        size = chunk_sizes[index % len(chunk_sizes)]
        pieces.append(stream.feed(samples[start : start + size]))
        start, index = start + size, index + 1
    streamed = np.concatenate([*pieces, stream.flush()])
    np.testing.assert_array_equal(streamed, resample(samples, 24_000, SAMPLE_RATE))
    assert streamed.size == 32_000


# Multi-channel uploads, each with its channels in the sample format its decoder gives: packed and
# planar integers, planar float (AAC), and 64 channels in no named order.
_MULTI_CHANNEL = [
    *((case.name, case.upload, case.layout) for case in MANY_CHANNEL_UPLOADS),
    ("wav-octagonal", UploadFormat("wav", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE), "octagonal"),
    ("wav-9-channels", UploadFormat("wav", "wav", "wav", "pcm_f32le", "flt", SAMPLE_RATE), "9C"),
    (
        "nut-planar-64-channels",
        UploadFormat("nut", "nut", "nut", "pcm_s16le_planar", "s16p", SAMPLE_RATE),
        "64C",
    ),
]


@pytest.mark.parametrize(
    ("upload", "layout"), [case[1:] for case in _MULTI_CHANNEL], ids=[case[0] for case in _MULTI_CHANNEL]
)
def test_every_channel_layout_decodes_to_the_mean_of_its_channels(upload: UploadFormat, layout: str, jfk):
    """Speech in one channel of many, silence in the rest: the mono mix is the speech divided by
    the channel count (the mean), for layouts whose planar frames PyAV cannot read (8 and more)."""
    speech = jfk[: 3 * SAMPLE_RATE]
    count = av.AudioLayout(layout).nb_channels
    channels = np.zeros((count, speech.size), np.float32)
    channels[count // 2] = speech
    decoded = decode_audio(encode_channels(channels, upload, layout)) * count
    if upload.codec == "aac":  # lossy: the same speech, after the encoder's priming delay
        assert _aligned_correlation(speech, decoded) > 0.9
        return
    assert len(decoded) == len(speech)
    np.testing.assert_allclose(decoded, speech, atol=3 / 2**15)


def _wav_header_and_samples(channels: int, frames: int) -> bytes:
    """A 16-bit PCM WAV of ``channels`` channels written by hand: PyAV's encoders stop at 64."""
    data = np.zeros((frames, channels), "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, SAMPLE_RATE, SAMPLE_RATE * 2 * channels, 2 * channels, 16)
    chunks = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


@pytest.mark.parametrize("channels", [65, 255])
def test_more_channels_than_the_resampler_takes_are_refused_in_words(channels):
    with pytest.raises(AudioDecodeError, match=f"has {channels} channels; this server reads 1 to 64"):
        decode_audio(_wav_header_and_samples(channels, 1600))


def test_float_samples_far_past_full_scale_are_refused_in_words(jfk):
    wav_float = UploadFormat("wav", "wav", "wav", "pcm_f32le", "flt", SAMPLE_RATE)
    absurd = jfk.copy()
    absurd[1000] = 1e30  # finite, but its power overflows float32 in the log-mel
    with pytest.raises(AudioDecodeError, match="samples reach 1e\\+30, far outside full scale"):
        decode_audio(encode(absurd, wav_float))
    # Integer PCM stored as unscaled floats is wrongly scaled, not absurd: it is taken as sent.
    integer_scaled = decode_audio(encode(jfk * 2**15 * 0.99, wav_float))
    np.testing.assert_allclose(integer_scaled, jfk * 2**15 * 0.99, rtol=1e-6)
