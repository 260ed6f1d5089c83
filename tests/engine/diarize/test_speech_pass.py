"""A recording whose speech was found already (the ingress's Silero pass) is diarized from that
pass: the same turns, and no second run of the model over the same audio."""

from __future__ import annotations

import numpy as np
import pytest

from engine.diarize import DiarizationRequest
from engine.transcribe import speech
from engine.transcribe.speech import speech_probabilities


@pytest.mark.slow
def test_a_recording_with_its_vad_pass_is_diarized_to_the_same_turns_without_running_vad_again(
    runs, monkeypatch
):
    conversation = runs.conversations["three_speakers"]
    probabilities = speech_probabilities(conversation.samples)
    alone = runs.ours("three_speakers")

    def no_second_pass():
        raise AssertionError("the diarizer ran Silero VAD over audio whose pass it was given")

    monkeypatch.setattr(speech, "load_silero_vad", no_second_pass)
    (handed,) = runs.diarizer.diarize(
        [DiarizationRequest(conversation.samples, speech_probabilities=probabilities)]
    )
    assert [(t.speaker, t.start_s, t.end_s) for t in handed.turns] == [
        (t.speaker, t.start_s, t.end_s) for t in alone.turns
    ]


def test_a_vad_pass_of_other_audio_is_refused():
    samples = np.zeros(16000, dtype=np.float32)  # 32 frames of 512 samples, the last one padded
    with pytest.raises(ValueError, match="speech_probabilities has 10 frames; 16000 samples make 32"):
        DiarizationRequest(samples, speech_probabilities=np.zeros(10, dtype=np.float32))
