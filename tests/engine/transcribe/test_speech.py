"""Speech detection policy: probabilities -> padded regions -> windows of at most 30 s packed from
them, with the audio between windows left out and each window a span of the file."""

from __future__ import annotations

import numpy as np

from engine.model.audio import N_SAMPLES, SAMPLE_RATE
from engine.model.vad import FRAME_S, FRAME_SAMPLES
from engine.transcribe.speech import SpeechOptions, SpeechRegion, speech_regions, speech_windows


def _probabilities(duration_s: float, speech_s: list[tuple[float, float]], level: float = 0.9) -> np.ndarray:
    times_s = np.arange(int(duration_s / FRAME_S)) * FRAME_S
    probabilities = np.full(len(times_s), 0.05, dtype=np.float32)
    for start_s, end_s in speech_s:
        probabilities[(times_s >= start_s) & (times_s < end_s)] = level
    return probabilities


def test_regions_are_the_speech_padded_on_both_sides():
    options = SpeechOptions(prefix_padding_ms=300, silence_duration_ms=500)
    regions = speech_regions(_probabilities(20, [(2, 4), (10, 13)]), 20 * SAMPLE_RATE, options)
    assert [(round(r.start_s, 1), round(r.end_s, 1)) for r in regions] == [(1.7, 4.3), (9.7, 13.3)]


def test_pauses_shorter_than_the_silence_duration_stay_inside_one_region():
    probabilities = _probabilities(20, [(2, 4), (4.5, 6)])
    assert len(speech_regions(probabilities, 20 * SAMPLE_RATE, SpeechOptions(silence_duration_ms=1000))) == 1
    assert (
        len(
            speech_regions(
                probabilities, 20 * SAMPLE_RATE, SpeechOptions(silence_duration_ms=200, prefix_padding_ms=0)
            )
        )
        == 2
    )


def test_short_blips_and_sub_threshold_frames_are_not_speech():
    probabilities = _probabilities(20, [(5, 5.1)])  # 100 ms: a click
    probabilities[300:400] = 0.4  # a murmur under the threshold
    assert speech_regions(probabilities, 20 * SAMPLE_RATE, SpeechOptions()) == []
    assert speech_regions(
        probabilities, 20 * SAMPLE_RATE, SpeechOptions(threshold=0.3, min_speech_duration_ms=0)
    )


def test_speech_running_to_the_end_ends_at_the_audio():
    regions = speech_regions(_probabilities(10, [(8, 10)]), 10 * SAMPLE_RATE - 100, SpeechOptions())
    assert regions[-1].end_sample == 10 * SAMPLE_RATE - 100


def test_windows_pack_whole_regions_into_at_most_30_s_and_leave_the_rest_out():
    samples = np.arange(200 * SAMPLE_RATE, dtype=np.float32)  # each sample's value is its position
    seconds = [(1, 8), (10, 20), (25, 29), (60, 70), (150, 190)]  # the last is longer than 30 s
    regions = [SpeechRegion(a * SAMPLE_RATE, b * SAMPLE_RATE) for a, b in seconds]
    windows = speech_windows(samples, regions)
    assert all(len(w.samples) <= N_SAMPLES for w in windows)
    # 7 + 10 + 4 s in the first window; 10 s more would pass 30 s.
    assert [len(w.samples) / SAMPLE_RATE for w in windows[:2]] == [21.0, 10.0]
    kept = np.concatenate([w.samples for w in windows])
    expected = np.concatenate([samples[r.start_sample : r.end_sample] for r in regions])
    np.testing.assert_array_equal(kept, expected)  # every region's audio, once, in order; nothing else


def test_a_packed_windows_times_map_back_to_where_its_pieces_lie_in_the_file():
    samples = np.zeros(100 * SAMPLE_RATE, dtype=np.float32)
    regions = [SpeechRegion(a * SAMPLE_RATE, b * SAMPLE_RATE) for a, b in [(5, 9), (40, 46), (70, 72)]]
    (window,) = speech_windows(samples, regions)
    timeline = window.timeline
    assert timeline.file_s(0.0) == 5.0 and timeline.file_s(3.5) == 8.5
    assert timeline.file_s(4.0, at_end=True) == 9.0 and timeline.file_s(4.0) == 40.0
    assert timeline.file_s(11.0) == 71.0 and timeline.end_s == 72.0 and timeline.start_s == 5.0


def test_no_regions_give_no_windows():
    assert speech_windows(np.zeros(45 * SAMPLE_RATE, np.float32), []) == []
    assert FRAME_SAMPLES == 512


def test_a_segment_crossing_a_join_by_a_little_is_dated_in_the_piece_it_mostly_lies_in():
    samples = np.zeros(100 * SAMPLE_RATE, dtype=np.float32)
    regions = [SpeechRegion(a * SAMPLE_RATE, b * SAMPLE_RATE) for a, b in [(5, 9), (40, 46)]]
    (window,) = speech_windows(samples, regions)
    # Whisper starts the second sentence 0.2 s before the join (window time 4 s).
    assert window.timeline.file_span_s(3.8, 8.0) == (40.0, 44.0)
    assert window.timeline.file_span_s(1.0, 4.3) == (6.0, 9.0)  # and ends the first 0.3 s after it
    assert window.timeline.file_span_s(1.0, 6.0) == (6.0, 42.0)  # one that spans both stays so
