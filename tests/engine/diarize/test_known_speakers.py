"""Naming diarized speakers from reference recordings of known speakers."""

from __future__ import annotations

import numpy as np
import pytest
from pyannote.metrics.diarization import DiarizationErrorRate

from engine.diarize import match_known_speakers
from engine.model.audio import SAMPLE_RATE, load_audio_file
from tests.engine.diarize.conftest import annotation, reference
from tests.support.speech import SPEECH_DIR


def test_a_speaker_takes_the_name_of_the_reference_its_voice_is_closest_to():
    centroids = {0: np.array([1.0, 0.1, 0.0]), 1: np.array([0.0, 1.0, 0.1]), 2: np.array([0.1, 0.0, 1.0])}
    references = {"ana": np.array([0.05, 0.9, 0.0]), "bo": np.array([0.9, 0.0, 0.05])}
    assert match_known_speakers(centroids, references) == {0: "bo", 1: "ana"}


def test_a_voice_below_the_threshold_keeps_no_name():
    centroids = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0])}
    assert match_known_speakers(centroids, {"ana": np.array([1.0, 1.0])}, threshold=0.8) == {}


def test_two_speakers_never_share_one_name():
    centroids = {0: np.array([1.0, 0.0]), 1: np.array([0.95, 0.05])}
    assert match_known_speakers(centroids, {"ana": np.array([1.0, 0.02])}, threshold=0.5) == {0: "ana"}


def _reference_clip(name: str) -> np.ndarray:
    if name == "osr":
        clips = [load_audio_file(SPEECH_DIR / f"osr72_0{index}.flac") for index in (1, 2, 3, 4)]
        return np.concatenate(clips)
    return load_audio_file(SPEECH_DIR / "multilingual.flac")[int(1.7 * SAMPLE_RATE) : int(9.7 * SAMPLE_RATE)]


@pytest.mark.slow
def test_with_references_for_two_of_three_speakers_those_two_are_named_and_the_third_is_not(runs):
    name = "three_speakers"
    result = runs.ours(name)
    hypothesis = annotation([(turn.speaker, turn.start_s, turn.end_s) for turn in result.turns])
    # Which diarized speaker is which voice of the construction, by the turns they share.
    true_voice = DiarizationErrorRate().optimal_mapping(reference(runs.conversations[name]), hypothesis)
    references = {
        voice: runs.diarizer.voice_embedding(_reference_clip(voice)) for voice in ("osr", "multi_en")
    }
    names = match_known_speakers(result.centroids, references)
    assert sorted(names.values()) == ["multi_en", "osr"]
    for speaker, voice in names.items():
        assert true_voice[speaker] == voice
    unnamed = [speaker for speaker in result.centroids if speaker not in names]
    assert [true_voice.get(speaker) for speaker in unnamed] == ["tts_m3"]
