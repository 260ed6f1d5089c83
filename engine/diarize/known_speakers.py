"""Naming speakers: a diarized speaker takes a known speaker's name when its voice (centroid) is
close enough to that speaker's reference recording, as OpenAI's ``known_speaker_names[]`` with
``known_speaker_references[]`` asks.

Each name goes to at most one speaker and each speaker takes at most one name: the closest pairs
are matched first, so two similar voices never both claim one reference.
"""

from __future__ import annotations

import numpy as np

from engine.diarize.similarity import KNOWN_SPEAKER_THRESHOLD, cosine_similarity


def match_known_speakers(
    centroids: dict[int, np.ndarray],
    references: dict[str, np.ndarray],
    threshold: float = KNOWN_SPEAKER_THRESHOLD,
) -> dict[int, str]:
    """Speaker -> the name of the reference it matches; unmatched speakers are left out."""
    pairs = sorted(
        (
            (cosine_similarity(centroid, reference), speaker, name)
            for speaker, centroid in centroids.items()
            for name, reference in references.items()
        ),
        reverse=True,
    )
    names: dict[int, str] = {}
    taken: set[str] = set()
    for similarity, speaker, name in pairs:
        if similarity < threshold:
            break
        if speaker not in names and name not in taken:
            names[speaker] = name
            taken.add(name)
    return names
