"""A batch's samples through the encoder's reused buffer (engine/encode/staging.py): what the
encoder gets equals the stacked, padded or trimmed windows, whatever an earlier batch left in the
same rows, and a batch larger than the buffer grows it. The page-locked GPU path is in
tests/engine/test_gpu_agreement.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.encode.runner import EncoderRunner
from engine.encode.staging import WindowStaging
from engine.model.audio import N_SAMPLES, SAMPLE_RATE
from tests.support.speech import short_english_clips, windows_of


def test_windows_of_any_length_arrive_padded_or_trimmed_and_rows_reused_hold_nothing_of_before():
    noise = np.random.default_rng(0)
    long_batch = [noise.standard_normal(N_SAMPLES + 999).astype(np.float32) for _ in range(3)]
    short_batch = [noise.standard_normal(length).astype(np.float32) for length in (SAMPLE_RATE, 7, N_SAMPLES)]
    staging = WindowStaging(torch.device("cpu"), rows=3)
    assert torch.equal(staging.to_device(long_batch), windows_of(long_batch))
    # The same rows again, shorter windows: what the long ones wrote past their ends must be zeros now.
    staged = staging.to_device(short_batch)
    assert torch.equal(staged, windows_of(short_batch))
    assert not staged[0, SAMPLE_RATE:].any() and not staged[1, 7:].any()


def test_a_batch_larger_than_the_buffer_grows_it():
    noise = np.random.default_rng(1)
    windows = [noise.standard_normal(SAMPLE_RATE * (index + 1)).astype(np.float32) for index in range(5)]
    staging = WindowStaging(torch.device("cpu"), rows=2)
    assert torch.equal(staging.to_device(windows), windows_of(windows))
    assert torch.equal(staging.to_device(windows[:1]), windows_of(windows[:1]))


@pytest.mark.slow
def test_the_encoder_gives_the_same_states_from_each_windows_samples_as_from_a_stacked_batch(tiny_en):
    runner = EncoderRunner(tiny_en)
    clips = [clip.path for clip in short_english_clips()[:3]]
    stacked = windows_of(clips)
    samples = [row[: SAMPLE_RATE * (index + 3)].numpy() for index, row in enumerate(stacked)]
    torch.testing.assert_close(runner.encode(samples), runner.encode(windows_of(samples)), rtol=0, atol=0)
