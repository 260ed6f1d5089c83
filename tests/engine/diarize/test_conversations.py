"""The generated conversations: deterministic, with the turns their audio holds."""

from __future__ import annotations

import numpy as np

from engine.model.audio import SAMPLE_RATE
from tests.support.conversations import conversation, standard_conversations, stereo_call


def test_the_same_seed_builds_the_same_conversation():
    first = conversation("a", ["jfk", "tts_f2"], 20.0, seed=11)
    again = conversation("a", ["jfk", "tts_f2"], 20.0, seed=11)
    other = conversation("a", ["jfk", "tts_f2"], 20.0, seed=12)
    assert np.array_equal(first.samples, again.samples) and first.turns == again.turns
    assert first.turns != other.turns


def test_the_standard_conversations_have_their_speakers_pauses_and_overlaps():
    for item, count in zip(standard_conversations(), (2, 3, 4)):
        assert len(item.speakers) == count
        assert 60 <= item.duration_s <= 300
        gaps = [b.start_s - a.end_s for a, b in zip(item.turns, item.turns[1:])]
        assert any(gap > 0.3 for gap in gaps) and any(gap < 0 for gap in gaps)


def test_reference_turns_hold_speech_and_the_rest_is_the_noise_floor():
    item = standard_conversations()[0]
    speech = np.zeros(len(item.samples), dtype=bool)
    for turn in item.turns:
        speech[int(turn.start_s * SAMPLE_RATE) : int(turn.end_s * SAMPLE_RATE)] = True
    assert np.sqrt(np.mean(item.samples[~speech] ** 2)) < 0.002
    assert np.sqrt(np.mean(item.samples[speech] ** 2)) > 0.05


def test_the_stereo_call_puts_each_party_on_its_own_channel():
    call = stereo_call()
    assert call.samples.shape[0] == 2
    for channel, speaker in enumerate(call.speakers):
        own = np.zeros(call.samples.shape[1], dtype=bool)
        for turn in call.turns:
            if turn.speaker == speaker:
                own[int(turn.start_s * SAMPLE_RATE) : int(turn.end_s * SAMPLE_RATE)] = True
        assert np.sqrt(np.mean(call.samples[channel][~own] ** 2)) < 0.002
        assert np.sqrt(np.mean(call.samples[channel][own] ** 2)) > 0.05
