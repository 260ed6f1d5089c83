"""Long audio is cut into windows at quiet points, and timestamp tokens cut a window's text into
timed segments."""

from __future__ import annotations

import numpy as np
import pytest

from engine.audio import N_SAMPLES, SAMPLE_RATE, load_audio_file
from engine.decoding import timed_segments
from engine.evaluation import word_error_rate
from engine.offline import Transcriber
from engine.transcript import split_windows
from tests.conftest import english_clips


@pytest.mark.parametrize("gap_at_s", [26.0, 29.5])
def test_windows_cover_the_audio_exactly_and_end_in_the_pause(gap_at_s):
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(SAMPLE_RATE * 70)).astype(np.float32)  # 70 s of "speech"
    gap = slice(int(gap_at_s * SAMPLE_RATE), int((gap_at_s + 0.3) * SAMPLE_RATE))
    audio[gap] = 0.0
    windows = split_windows(audio)
    assert all(len(w.samples) <= N_SAMPLES for w in windows)
    assert np.array_equal(np.concatenate([w.samples for w in windows]), audio)
    assert [w.start_sample for w in windows[1:]] == [w.start_sample + len(w.samples) for w in windows[:-1]]
    assert gap.start <= windows[1].start_sample < gap.stop, "the first cut falls inside the silent gap"


def test_the_long_form_clip_is_cut_between_sentences_and_loses_no_words(tiny_en):
    clip = next(c for c in english_clips() if c.duration_s > 30)
    windows = split_windows(load_audio_file(clip.path))
    assert len(windows) == 2 and windows[1].start_s < 30
    transcript = Transcriber(loaded=tiny_en).transcribe([clip.path])[0]
    assert word_error_rate([clip.text], [transcript.text]) <= 0.02


def test_pairs_of_timestamps_close_and_open_segments_and_the_tail_runs_to_the_window_end(tiny_en):
    tokenizer = tiny_en.tokenizer
    begin = tokenizer.special.timestamp_begin
    hello, world = tokenizer.encode(" hello"), tokenizer.encode(" world")
    # <|0.00|> hello <|1.00|><|1.00|> world <|2.50|><|2.50|> hello   (no closing timestamp)
    tokens = [begin, *hello, begin + 50, begin + 50, *world, begin + 125, begin + 125, *hello]
    segments = timed_segments(tokenizer, tokens, window_s=30.0)
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [
        (0.0, 1.0, " hello"), (1.0, 2.5, " world"), (2.5, 30.0, " hello")
    ]
    assert segments[1].tokens == world


def test_text_without_any_timestamp_is_one_segment_over_the_window(tiny_en):
    segments = timed_segments(tiny_en.tokenizer, tiny_en.tokenizer.encode(" just words"), window_s=12.0)
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [(0.0, 12.0, " just words")]
