"""A live session's speakers from real voices: each turn embedded by engine/diarize's Diarizer (as
the diarizer deployment embeds it) and matched against the session's speakers so far."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.orchestration.session_speakers import SessionSpeakers
from engine.diarize import Diarizer, SpeakerEncoderOptions
from engine.model.audio import SAMPLE_RATE, load_audio_file
from tests.support.speech import SPEECH_DIR
from tests.support.threads import reference_threads


@pytest.fixture(scope="module")
def diarizer() -> Diarizer:
    return Diarizer(SpeakerEncoderOptions(threads=reference_threads()))


@pytest.fixture(scope="module")
def turns(diarizer: Diarizer) -> dict[str, np.ndarray | None]:
    """Voices of turns by two people: JFK's speech cut in two, and two sentences of one OSR reader."""
    jfk = load_audio_file(SPEECH_DIR / "jfk.flac")
    half = len(jfk) // 2
    clips = {
        "jfk_first": jfk[:half],
        "jfk_second": jfk[half:],
        "osr_first": load_audio_file(SPEECH_DIR / "osr72_01.flac"),
        "osr_second": load_audio_file(SPEECH_DIR / "osr72_02.flac"),
        "silence": np.zeros(2 * SAMPLE_RATE, dtype=np.float32),
    }
    return {name: diarizer.voice_embedding(samples) for name, samples in clips.items()}


def test_turns_of_two_people_alternating_keep_their_first_speakers(turns):
    speakers = SessionSpeakers()
    order = ["jfk_first", "osr_first", "jfk_second", "osr_second"]
    assert [speakers.speaker_of(turns[name]) for name in order] == [0, 1, 0, 1]
    assert speakers.num_speakers == 2


def test_a_turn_without_speech_gets_no_speaker_and_opens_none(turns):
    speakers = SessionSpeakers()
    assert turns["silence"] is None
    assert speakers.speaker_of(turns["silence"]) is None
    assert speakers.speaker_of(turns["jfk_first"]) == 0
    assert speakers.num_speakers == 1


def test_a_threshold_no_voice_reaches_makes_every_turn_a_new_speaker(turns):
    # The threshold is what separates people: above any similarity, even one person's turns part.
    speakers = SessionSpeakers(threshold=1.01)
    assert [speakers.speaker_of(turns[name]) for name in ("jfk_first", "jfk_second")] == [0, 1]


def test_matching_a_voice_leaves_the_callers_embedding_as_it_was(turns):
    speakers = SessionSpeakers()
    first = np.array(turns["jfk_first"], dtype=np.float64)
    kept = first.copy()
    speakers.speaker_of(first)
    speakers.speaker_of(turns["jfk_second"])
    assert np.array_equal(first, kept)
