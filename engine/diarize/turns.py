"""A recording's labelled windows -> speaker turns.

Each window speaks for its speech span (engine/diarize/segmentation.py). Consecutive windows of one
speaker join into a turn while their spans touch or overlap; where two speakers' windows overlap,
the boundary is put halfway through the overlap, the best guess a 0.6 s window hop allows. Spans
apart (a pause the VAD found) start a new turn even for the same speaker, so a turn never covers
silence, and a word said in a pause is given to the nearest turn by word assignment instead.
"""

from __future__ import annotations

import numpy as np

from engine.diarize.types import SpeakerTurn, Subsegment
from engine.model.audio import SAMPLE_RATE


def speaker_turns(subsegments: list[Subsegment], labels: np.ndarray) -> list[SpeakerTurn]:
    """Windows in time order and their speaker labels -> turns in time order."""
    turns: list[SpeakerTurn] = []
    for window, label in zip(subsegments, labels):
        speaker = int(label)
        start_s = window.speech_start_sample / SAMPLE_RATE
        end_s = window.speech_end_sample / SAMPLE_RATE
        if not turns or start_s > turns[-1].end_s:
            turns.append(SpeakerTurn(speaker, start_s, end_s))
            continue
        previous = turns[-1]
        if speaker == previous.speaker:
            turns[-1] = SpeakerTurn(speaker, previous.start_s, max(previous.end_s, end_s))
            continue
        boundary = (max(start_s, previous.start_s) + previous.end_s) / 2
        turns[-1] = SpeakerTurn(previous.speaker, previous.start_s, boundary)
        turns.append(SpeakerTurn(speaker, boundary, end_s))
    return [turn for turn in turns if turn.end_s > turn.start_s]


def speaker_centroids(embeddings: np.ndarray, labels: np.ndarray) -> dict[int, np.ndarray]:
    """Each speaker's mean window embedding."""
    return {int(label): embeddings[labels == label].mean(axis=0) for label in np.unique(labels)}
