"""Diarization error rate of our pipeline against senko's own, on the generated conversations."""

from __future__ import annotations

import pytest
from pyannote.metrics.diarization import DiarizationErrorRate

from engine.diarize import DiarizationRequest
from tests.engine.diarize.conftest import annotation, reference

CONVERSATIONS = ["two_speakers", "three_speakers", "four_speakers"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_our_error_rate_is_within_a_point_of_senkos_on_the_same_audio(runs, name):
    conversation = runs.conversations[name]
    ours = annotation([(turn.speaker, turn.start_s, turn.end_s) for turn in runs.ours(name).turns])
    our_rate = DiarizationErrorRate(collar=0.25)(reference(conversation), ours)
    senko_rate = DiarizationErrorRate(collar=0.25)(reference(conversation), runs.senko(name))
    print(f"{name}: DER ours {our_rate:.3f}, senko {senko_rate:.3f}")
    assert our_rate <= senko_rate + 0.01


@pytest.mark.slow
def test_diarizing_recordings_together_gives_the_turns_of_diarizing_each_alone(runs):
    together = runs.diarizer.diarize(
        [DiarizationRequest(runs.conversations[name].samples) for name in CONVERSATIONS]
    )
    for name, result in zip(CONVERSATIONS, together):
        alone = runs.ours(name)
        assert [turn.speaker for turn in result.turns] == [turn.speaker for turn in alone.turns]
        for joint, single in zip(result.turns, alone.turns):
            assert joint.start_s == pytest.approx(single.start_s, abs=1e-6)
            assert joint.end_s == pytest.approx(single.end_s, abs=1e-6)


@pytest.mark.slow
def test_fixing_the_speaker_count_gives_that_many_speakers(runs):
    conversation = runs.conversations["four_speakers"]
    (result,) = runs.diarizer.diarize(
        [DiarizationRequest(conversation.samples, min_speakers=4, max_speakers=4)]
    )
    assert result.num_speakers == 4
    assert {turn.speaker for turn in result.turns} == {0, 1, 2, 3}
