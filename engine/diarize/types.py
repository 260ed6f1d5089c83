"""What crosses the diarizer's boundary: a request's audio and bounds in, speaker turns out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.model.vad import FRAME_SAMPLES


@dataclass(frozen=True)
class DiarizationRequest:
    """One recording to diarize: 16 kHz mono float32 samples, and optional bounds on the number of
    speakers (OpenAI's vendor fields ``min_speakers`` / ``max_speakers``); equal bounds fix it.

    ``speech_probabilities``: Silero VAD's per-frame probabilities of ``samples``
    (engine/transcribe/speech.py ``speech_probabilities``) when the caller ran that pass already,
    as the ingress does to cut a request's windows at speech; the diarizer then reads its speech
    regions from them instead of running the model a second time over the same audio. None: the
    diarizer runs it."""

    samples: np.ndarray
    min_speakers: int | None = None
    max_speakers: int | None = None
    speech_probabilities: np.ndarray | None = None

    def __post_init__(self):
        if self.speech_probabilities is not None:
            frames = -(-len(self.samples) // FRAME_SAMPLES)
            if len(self.speech_probabilities) != frames:
                raise ValueError(
                    f"speech_probabilities has {len(self.speech_probabilities)} frames; "
                    f"{len(self.samples)} samples make {frames}"
                )
        for name in ("min_speakers", "max_speakers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.min_speakers and self.max_speakers and self.min_speakers > self.max_speakers:
            raise ValueError(
                f"min_speakers ({self.min_speakers}) must not exceed max_speakers ({self.max_speakers})"
            )


@dataclass(frozen=True)
class Subsegment:
    """A short stretch of speech that gets one speaker embedding, in samples of its recording.

    The embedding is taken over ``start_sample:end_sample``, a fixed-length window; the label it
    yields speaks for ``speech_start_sample:speech_end_sample``, the window's part inside its speech
    region. A region shorter than the window is embedded with the audio before it (a speaker
    embedding of a few hundred milliseconds is noise) but labels only its own speech."""

    start_sample: int
    end_sample: int
    speech_start_sample: int
    speech_end_sample: int


@dataclass(frozen=True)
class SpeakerTurn:
    """A stretch of the recording where one speaker talks. Speakers are numbered from 0 in the order
    they first speak."""

    speaker: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Diarization:
    """A recording's speaker turns, in time order, and each speaker's voice: the mean of the
    speaker embeddings of its subsegments (``centroids[speaker]``), to match against known
    speakers' references or a live session's earlier speakers."""

    turns: list[SpeakerTurn]
    centroids: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def num_speakers(self) -> int:
        return len(self.centroids)
