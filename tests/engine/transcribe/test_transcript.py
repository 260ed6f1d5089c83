"""Long audio is cut into windows at quiet points, timestamp tokens cut a window's text into
timed segments, and sequential mode seeks by them."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decode.results import timed_segments
from engine.model.audio import N_SAMPLES, SAMPLE_RATE, load_audio_file
from engine.transcribe.evaluation import word_error_rate
from engine.transcribe.offline import Transcriber
from engine.transcribe.windows import SequentialCursor, split_windows
from engine.types import DecodeOptions, DecodeResult, FinishReason, TimedText
from tests.support.speech import english_clips


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


@pytest.mark.slow
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
        (0.0, 1.0, " hello"),
        (1.0, 2.5, " world"),
        (2.5, 30.0, " hello"),
    ]
    assert segments[1].tokens == world


def test_text_without_any_timestamp_is_one_segment_over_the_window(tiny_en):
    segments = timed_segments(tiny_en.tokenizer, tiny_en.tokenizer.encode(" just words"), window_s=12.0)
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [(0.0, 12.0, " just words")]


def _result(tokens: list[int], segments: list[TimedText], temperature: float = 0.0) -> DecodeResult:
    return DecodeResult(
        "w",
        tokens,
        "".join(s.text for s in segments),
        -0.2,
        0.01,
        "en",
        temperature,
        FinishReason.STOP,
        segments=segments,
    )


def test_sequential_mode_drops_an_unfinished_last_segment_and_starts_the_next_window_at_it():
    samples = np.zeros(SAMPLE_RATE * 65, dtype=np.float32)
    cursor = SequentialCursor(samples, DecodeOptions(prompt="earlier words"))
    window, options = cursor.next_window()
    assert window.start_sample == 0 and len(window.samples) == N_SAMPLES
    assert options.timestamps and options.prompt == "earlier words", (
        "the caller's prompt conditions the first window"
    )
    ts = {0.0: 50363, 5.0: 50613}  # timestamp tokens (ids do not matter here)
    tokens = [ts[0.0], 11, 12, ts[5.0], ts[5.0], 13, 14]
    segments = [
        TimedText(0.0, 5.0, " one two", [11, 12]),
        TimedText(5.0, 30.0, " three four", [13, 14], closed=False),
    ]
    kept = cursor.accept(window, _result(tokens, segments))
    assert kept.text == " one two" and kept.segments == segments[:1] and kept.tokens == tokens[:4]
    window, options = cursor.next_window()
    assert window.start_sample == 5 * SAMPLE_RATE, "the next window starts where the dropped segment began"
    assert options.prompt == tuple(tokens[:4]), "and is conditioned on the kept tokens, timestamps included"
    # A hot window (temperature > 0.5) is not passed on as a prompt, and a closed window is kept whole.
    cursor.accept(
        window, _result([ts[0.0], 15, ts[5.0]], [TimedText(0.0, 5.0, " five", [15])], temperature=0.8)
    )
    window, options = cursor.next_window()
    assert window.start_sample == 35 * SAMPLE_RATE and options.prompt is None
    cursor.accept(window, _result([], []))
    assert cursor.next_window() is None
    assert cursor.transcription().window_starts_s == [0.0, 5.0, 35.0]
