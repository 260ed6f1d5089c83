"""The diarizer: recordings in, speaker turns out, the recordings' windows embedded together.

The steps, each in its own module: speech regions and windows (segmentation.py), one speaker
embedding per window in batches shared by every recording of the call (embeddings.py), clustering
per recording within its speaker bounds (clustering.py), and turns from the labelled windows
(turns.py).
"""

from __future__ import annotations

import numpy as np

from engine.diarize.clustering import cluster_speakers
from engine.diarize.embeddings import RecordingWindows, SpeakerEncoder, SpeakerEncoderOptions
from engine.diarize.segmentation import SubsegmentOptions, diarization_regions, subsegments
from engine.diarize.turns import speaker_centroids, speaker_turns
from engine.diarize.types import Diarization, DiarizationRequest


class Diarizer:
    """Loads the speaker encoder once; ``diarize`` takes any number of recordings."""

    def __init__(
        self,
        encoder_options: SpeakerEncoderOptions = SpeakerEncoderOptions(),
        subsegment_options: SubsegmentOptions = SubsegmentOptions(),
    ):
        self.encoder = SpeakerEncoder(encoder_options)
        self.subsegment_options = subsegment_options

    def diarize(self, requests: list[DiarizationRequest]) -> list[Diarization]:
        """Each request's speaker turns and speaker centroids, in the order given."""
        windows = [
            RecordingWindows(
                request.samples,
                subsegments(
                    diarization_regions(request.samples, request.speech_probabilities),
                    self.subsegment_options,
                ),
            )
            for request in requests
        ]
        embeddings = self.encoder.embed(windows)
        results = []
        for request, recording, recording_embeddings in zip(requests, windows, embeddings):
            labels = cluster_speakers(recording_embeddings, request.min_speakers, request.max_speakers)
            results.append(
                Diarization(
                    speaker_turns(recording.subsegments, labels),
                    speaker_centroids(recording_embeddings, labels),
                )
            )
        return results

    def voice_embedding(self, samples: np.ndarray) -> np.ndarray | None:
        """One speaker's voice from a clip of only them (a known speaker's reference): the mean
        embedding of its speech windows, or None when it holds no speech."""
        recording = RecordingWindows(
            samples, subsegments(diarization_regions(samples), self.subsegment_options)
        )
        (embeddings,) = self.encoder.embed([recording])
        return embeddings.mean(axis=0) if len(embeddings) else None
