"""Whisper's timestamp tokens cut a window's text into timed segments."""

from __future__ import annotations

from engine.decoding import timed_segments


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
