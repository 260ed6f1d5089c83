"""The speakers of a live session so far: each diarized turn's voice (one speaker embedding of the
whole turn) goes to the session speaker it is closest to, or opens a new one, so that one person is
one speaker across the session's turns.

A speaker's voice is the running mean of the turns matched to it: later turns are compared with
everything heard of that person, not with their first turn alone.
"""

from __future__ import annotations

import numpy as np

from engine import SESSION_TURN_THRESHOLD, cosine_similarity


class SessionSpeakers:
    def __init__(self, threshold: float = SESSION_TURN_THRESHOLD):
        self.threshold = threshold
        self._centroids: list[np.ndarray] = []  # by speaker index, in order of appearance
        self._turns: list[int] = []  # turns matched to each speaker

    @property
    def num_speakers(self) -> int:
        return len(self._centroids)

    def speaker_of(self, voice: np.ndarray | None) -> int | None:
        """The index (from 0, in order of appearance) of the speaker whose voice this turn's is,
        a new speaker's when it matches none; None for a turn without a voice (no speech)."""
        if voice is None:
            return None
        voice = np.array(voice, dtype=np.float64)  # a copy: the centroid is updated in place
        similarities = [cosine_similarity(voice, centroid) for centroid in self._centroids]
        best = int(np.argmax(similarities)) if similarities else None
        if best is None or similarities[best] < self.threshold:
            self._centroids.append(voice)
            self._turns.append(1)
            return len(self._centroids) - 1
        self._turns[best] += 1
        self._centroids[best] += (voice - self._centroids[best]) / self._turns[best]
        return best
