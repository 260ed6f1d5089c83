"""The speaker encoder's fbank features against kaldi-native-fbank, window by window."""

from __future__ import annotations

import numpy as np
import pytest

from engine.diarize.fbank import NUM_MEL_BINS, num_frames, window_features
from tests.support.conversations import standard_conversations
from tests.support.kaldi_fbank import kaldi_fbank

WINDOW = 24000  # 1.5 s
SHIFT = 9600  # 0.6 s


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return standard_conversations()[0].samples[: 16000 * 20]


def _windows(length: int) -> list[tuple[int, int]]:
    # Overlapping windows of one region, the region's end-aligned tail window (off the others' frame
    # grid), a window that is not a whole number of hops, one at the very start shorter than a
    # frame, and one of a single frame.
    grid = [(1234 + SHIFT * k, 1234 + SHIFT * k + WINDOW) for k in range(8)]
    return [*grid, (length - WINDOW - 77, length - 77), (5000, 5000 + WINDOW - 123), (0, 250), (700, 1100)]


def test_each_windows_features_match_kaldi_native_fbank_computed_on_that_window_alone(speech):
    windows = _windows(len(speech))
    features = window_features(speech, windows)
    assert len(features) == len(windows)
    for (start, end), ours in zip(windows, features):
        reference = kaldi_fbank(speech[start:end])
        assert ours.shape == reference.shape == (num_frames(end - start), NUM_MEL_BINS)
        assert ours.dtype == np.float32
        # float32 FFTs in a different order: log energies agree to well under a thousandth.
        np.testing.assert_allclose(ours, reference, atol=2e-3)


def test_a_windows_features_do_not_depend_on_the_other_windows_asked_with_it(speech):
    windows = _windows(len(speech))
    together = window_features(speech, windows)
    for window, joint in zip(windows, together):
        (alone,) = window_features(speech, [window])
        np.testing.assert_allclose(joint, alone, rtol=0, atol=1e-6)


def test_no_windows_give_no_features(speech):
    assert window_features(speech, []) == []
