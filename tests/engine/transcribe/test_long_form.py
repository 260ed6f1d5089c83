"""A file over a minute long, built from speech-set clips with a second of silence between them:
the parallel long-form transcript is as accurate as the clips transcribed one by one, its segments
and words are in order on the file's timeline, and sequential mode (openai-whisper's loop) covers
the file window after window."""

from __future__ import annotations

import pytest

from engine.transcribe.evaluation import (
    LONG_FORM_CLIP_IDS,
    ConcatenatedSpeech,
    long_form_file,
    word_error_rate,
)
from engine.transcribe.offline import Transcriber
from engine.transcribe.windows import Transcription, split_windows
from engine.types import DecodeOptions
from tests.support.remembered_states import remembering_the_speech_set
from tests.support.speech import SPEECH_DIR, english_clips

WITH_WORDS = DecodeOptions(timestamps=True, word_timestamps=True)


@pytest.fixture(scope="module")
def long_file() -> ConcatenatedSpeech:
    return long_form_file(SPEECH_DIR)


@pytest.fixture(scope="module")
def transcriber(tiny_en) -> Transcriber:
    return Transcriber(loaded=tiny_en)


@pytest.fixture(scope="module")
def parallel(transcriber, long_file) -> Transcription:
    return transcriber.transcribe([long_file.samples], WITH_WORDS)[0]


@pytest.fixture(scope="module")
def sequential(transcriber, long_file) -> Transcription:
    return transcriber.transcribe(
        [long_file.samples], DecodeOptions(timestamps=True), long_form="sequential"
    )[0]


def _file_segments(transcription: Transcription):
    """(start_s, end_s, segment) on the file's timeline, clamped to each window as the formats do."""
    starts = transcription.window_starts_s
    for index, window in enumerate(transcription.windows):
        end_s = starts[index + 1] if index + 1 < len(starts) else transcription.duration_s
        for segment in window.segments:
            yield starts[index] + segment.start_s, min(starts[index] + segment.end_s, end_s), segment


def test_the_long_file_lasts_over_a_minute_and_is_cut_inside_its_silences(long_file):
    assert long_file.duration_s >= 60
    windows = split_windows(long_file.samples)
    assert len(windows) >= 3
    gaps = list(zip(long_file.clip_ends_s, long_file.clip_starts_s[1:]))
    for window in windows[1:]:
        assert any(end <= window.start_s <= start for end, start in gaps), (
            f"cut at {window.start_s:.2f} s is inside a clip"
        )


@pytest.mark.slow
def test_parallel_long_form_wer_is_within_a_point_of_the_clips_transcribed_one_by_one(
    tiny_en, speech_set_states, long_file, parallel
):
    clips = {clip.id: clip for clip in english_clips()}
    # The clips' encoder states as the run computes them once for every module (tests/conftest.py).
    transcriber = remembering_the_speech_set(tiny_en, speech_set_states).given_to(Transcriber(loaded=tiny_en))
    one_by_one = transcriber.transcribe([clips[clip_id].path for clip_id in LONG_FORM_CLIP_IDS], WITH_WORDS)
    clips_wer = word_error_rate([long_file.text], [" ".join(t.text for t in one_by_one)])
    long_wer = word_error_rate([long_file.text], [parallel.text])
    print(
        f"WER: long-form parallel {long_wer:.2%}, clips one by one {clips_wer:.2%} "
        f"({long_file.duration_s:.0f} s)"
    )
    assert long_wer <= clips_wer + 0.01


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_segment_timestamps_are_monotonic_and_inside_the_file(mode, parallel, sequential):
    transcription = parallel if mode == "parallel" else sequential
    times = [(start, end) for start, end, _ in _file_segments(transcription)]
    assert len(times) >= 10, "about one segment per sentence"
    assert all(0 <= start <= end <= transcription.duration_s for start, end in times)
    assert all(a[1] <= b[0] for a, b in zip(times, times[1:])), "segments are in order and do not overlap"
    assert times[-1][1] > transcription.duration_s - 10, (
        "the last window's segments sit on the file's timeline"
    )


def test_sequential_windows_each_start_where_the_previous_ones_finished_text_ended(long_file, sequential):
    starts = sequential.window_starts_s
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    assert all(b - a <= 30 for a, b in zip(starts, starts[1:] + [sequential.duration_s]))
    # A window's unfinished last segment is dropped and decoded again from the next window's start;
    # it stays only when it is the window's one segment (no timestamp to seek by, as openai-whisper).
    assert all(w.segments[-1].closed or len(w.segments) == 1 for w in sequential.windows if w.segments)
    wer = word_error_rate([long_file.text], [sequential.text])
    print(f"WER: long-form sequential {wer:.2%}")
    assert wer <= 0.25, "sequential mode transcribes the file, not a part of it"


def test_word_timestamps_are_monotonic_inside_their_segments_and_spell_the_segment_text(parallel):
    previous_start = 0.0
    for start_s, _end_s, segment in _file_segments(parallel):
        offset = start_s - segment.start_s
        assert segment.words, segment.text
        assert "".join(word.word for word in segment.words) == segment.text
        for word in segment.words:
            assert segment.start_s <= word.start_s <= word.end_s <= segment.end_s
            assert offset + word.start_s >= previous_start
            previous_start = offset + word.start_s


def test_words_land_where_they_are_spoken(parallel, long_file):
    """openai-whisper's own check on JFK ("Americans" spans 1.8 s), and every clip's first word
    starts near where that clip was placed in the file."""
    words = [
        (offset + word.start_s, offset + word.end_s, word.word)
        for start_s, _, segment in _file_segments(parallel)
        for offset in [start_s - segment.start_s]
        for word in segment.words
    ]
    americans = [w for w in words if w[2].strip(" ,") == "Americans"]
    assert americans and americans[0][0] <= 1.8 <= americans[0][1]
    for clip_start_s in long_file.clip_starts_s:
        nearest = min(abs(start - clip_start_s) for start, _, _ in words)
        assert nearest <= 0.6, f"no word starts within 0.6 s of the clip placed at {clip_start_s:.2f} s"
