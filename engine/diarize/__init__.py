"""Speaker diarization: who speaks when, and who said each word.

``Diarizer`` (pipeline.py) takes recordings and returns each one's speaker turns and voices, the
windows of all of them embedded in shared batches; ``split_by_speaker`` puts speakers on a
transcript; ``match_known_speakers`` names speakers from reference recordings; similarity.py holds
how alike two voices are and how alike counts as one person.
"""

from engine.diarize.assignment import SpeakerSegment, speaker_at, split_by_speaker, word_speakers
from engine.diarize.embeddings import SpeakerEncoderOptions
from engine.diarize.known_speakers import match_known_speakers
from engine.diarize.pipeline import Diarizer
from engine.diarize.similarity import KNOWN_SPEAKER_THRESHOLD, SESSION_TURN_THRESHOLD, cosine_similarity
from engine.diarize.types import Diarization, DiarizationRequest, SpeakerTurn

__all__ = [
    "Diarization",
    "DiarizationRequest",
    "Diarizer",
    "KNOWN_SPEAKER_THRESHOLD",
    "SESSION_TURN_THRESHOLD",
    "SpeakerEncoderOptions",
    "SpeakerSegment",
    "SpeakerTurn",
    "cosine_similarity",
    "match_known_speakers",
    "speaker_at",
    "split_by_speaker",
    "word_speakers",
]
