"""Silero VAD gives the probabilities Silero's own frame-at-a-time model gives, offline and streamed."""

from __future__ import annotations

import numpy as np
import torch

from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.model.vad import FRAME_S, FRAME_SAMPLES, load_silero_vad
from tests.support.speech import SPEECH_DIR


def test_offline_probabilities_match_silero_frame_at_a_time_model():
    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad as load_reference
    finally:
        torch.set_num_threads(threads)  # importing silero_vad sets it to 1 for the whole process
    samples = load_audio_file(SPEECH_DIR / "osr_list72.flac")
    ours = load_silero_vad().speech_probabilities(samples)
    reference = load_reference(onnx=True).audio_forward(torch.from_numpy(samples), SAMPLE_RATE)
    reference = reference.numpy().reshape(-1)
    assert ours.shape == (int(np.ceil(len(samples) / FRAME_SAMPLES)),)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_a_stream_fed_chunks_of_any_length_gives_the_offline_probabilities():
    vad = load_silero_vad()
    samples = load_audio_file(SPEECH_DIR / "jfk.flac")
    offline = vad.speech_probabilities(samples)
    stream = vad.stream()
    chunks, position = [], 0
    for length in np.random.default_rng(0).integers(1, 3 * FRAME_SAMPLES, size=len(samples)):
        if position >= len(samples):
            break
        probabilities = vad.feed(stream, samples[position : position + length])
        position += int(length)
        assert stream.frames_done == min(position, len(samples)) // FRAME_SAMPLES
        chunks.append(probabilities)
    chunks.append(vad.flush(stream))
    np.testing.assert_allclose(np.concatenate(chunks), offline, atol=1e-6)
    assert stream.processed_s == len(offline) * FRAME_S


def test_speech_inserted_into_silence_and_noise_is_where_the_probabilities_are_high():
    rng = np.random.default_rng(1)
    speech = load_audio_file(SPEECH_DIR / "osr72_01.flac")
    start, end = 4 * SAMPLE_RATE, 4 * SAMPLE_RATE + len(speech)
    for background in (np.zeros(end + 4 * SAMPLE_RATE), 0.01 * rng.standard_normal(end + 4 * SAMPLE_RATE)):
        audio = background.astype(np.float32)
        audio[start:end] += speech
        probabilities = load_silero_vad().speech_probabilities(audio)
        frame_times_s = np.arange(len(probabilities)) * FRAME_S
        outside = (frame_times_s < start / SAMPLE_RATE - 0.5) | (frame_times_s > end / SAMPLE_RATE + 0.5)
        inside = ~outside & (frame_times_s > start / SAMPLE_RATE) & (frame_times_s < end / SAMPLE_RATE)
        assert probabilities[outside].max() < 0.3
        assert (probabilities[inside] > 0.5).mean() > 0.5
