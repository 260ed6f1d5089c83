"""How alike two voices are, and how alike counts as one person: the cosine similarity of CAM++
speaker embeddings, and the bars a match must reach wherever speakers are matched by voice.

The bars live together because they are one scale read at two distances: what differs between
them is how much speech stands behind each side of the comparison (docs/diarization.md has the
measurements they were set from).
"""

from __future__ import annotations

import numpy as np

# A diarized speaker takes a known speaker's name (engine/diarize/known_speakers.py): both sides
# are voices of whole recordings (a speaker's centroid, a reference's mean embedding), steady
# enough that one person's score well above this bar and two people's (even two of espeak's voices,
# the closest pair in the test set) below it. Set high, because a wrong match puts a person's name
# on someone else's words, while a missed one only leaves a speaker unnamed.
KNOWN_SPEAKER_THRESHOLD = 0.75

# A live session's turn joins a speaker heard earlier in the session
# (deployments/orchestration/session_speakers.py): one side is a single turn of a few seconds, a
# noisier voice than a whole recording's, so one person's turns score below the known-speaker bar
# against each other; two people's turns still stay far below this lower one.
SESSION_TURN_THRESHOLD = 0.6


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norm) if norm > 0 else 0.0
