"""Each word to the speaker whose turn overlaps it most; segments cut where the speaker changes."""

from __future__ import annotations

from engine.diarize import SpeakerTurn, speaker_at, split_by_speaker, word_speakers
from engine.types import TimedText, TimedWord

TURNS = [SpeakerTurn(0, 0.0, 2.0), SpeakerTurn(1, 2.0, 4.0), SpeakerTurn(0, 5.0, 7.0)]


def word(text: str, start_s: float, end_s: float) -> TimedWord:
    return TimedWord(text, start_s, end_s, [])


def test_a_word_inside_one_turn_goes_to_that_turns_speaker():
    assert speaker_at(0.5, 0.9, TURNS) == 0
    assert speaker_at(2.5, 3.0, TURNS) == 1


def test_a_word_across_a_change_goes_to_the_speaker_it_overlaps_most():
    assert speaker_at(1.7, 2.1, TURNS) == 0
    assert speaker_at(1.9, 2.6, TURNS) == 1


def test_overlap_is_summed_over_one_speakers_turns():
    turns = [SpeakerTurn(0, 0.0, 1.0), SpeakerTurn(1, 1.0, 1.5), SpeakerTurn(0, 1.5, 2.0)]
    assert speaker_at(0.7, 1.9, turns) == 0  # 0.3 + 0.4 s of speaker 0 against 0.5 s of speaker 1


def test_a_word_in_a_pause_goes_to_the_nearest_turn():
    assert speaker_at(4.1, 4.3, TURNS) == 1
    assert speaker_at(4.7, 4.9, TURNS) == 0
    assert speaker_at(9.0, 9.5, TURNS) == 0


def test_without_turns_no_word_has_a_speaker():
    assert word_speakers([word(" hi", 0.0, 0.2)], []) == [None]


def test_a_segment_is_cut_where_the_speaker_changes():
    words = [word(" Are", 1.0, 1.2), word(" you", 1.2, 1.5), word(" there?", 1.5, 1.9)]
    words += [word(" Yes,", 2.1, 2.5), word(" I", 2.6, 2.7), word(" am.", 2.7, 3.0)]
    segment = TimedText(1.0, 3.0, "".join(w.word for w in words), [], words=words)
    pieces = split_by_speaker(segment, TURNS)
    assert [(p.speaker, p.text) for p in pieces] == [(0, " Are you there?"), (1, " Yes, I am.")]
    assert [(p.start_s, p.end_s) for p in pieces] == [(1.0, 1.9), (2.1, 3.0)]
    assert "".join(p.text for p in pieces) == segment.text


def test_a_segment_of_one_speaker_stays_whole():
    words = [word(" Fine", 5.2, 5.5), word(" thanks.", 5.5, 6.0)]
    pieces = split_by_speaker(TimedText(5.2, 6.0, " Fine thanks.", [], words=words), TURNS)
    assert [(p.speaker, p.text, len(p.words)) for p in pieces] == [(0, " Fine thanks.", 2)]


def test_a_segment_without_word_timings_goes_whole_to_the_speaker_of_its_span():
    pieces = split_by_speaker(TimedText(1.5, 3.9, " Hello there.", []), TURNS)
    assert [(p.speaker, p.text) for p in pieces] == [(1, " Hello there.")]
