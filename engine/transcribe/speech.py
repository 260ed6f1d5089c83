"""Speech detection policy: Silero VAD's per-frame probabilities (engine/model/vad.py) -> the
regions of a file that hold speech -> windows of at most 30 s packed from them.

Long audio is then cut where speech is, not at fixed or quiet points, and stretches without speech
are never encoded or decoded: no compute spent on them and no text hallucinated from them. A window
is the speech of several regions played one after another (as faster-whisper's VAD filter packs
them), keeping where each piece came from so timestamps land on the file's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model.audio import N_SAMPLES, SAMPLE_RATE
from engine.model.vad import FRAME_SAMPLES, load_silero_vad
from engine.transcribe.windows import AudioWindow, split_windows

# Below the speech threshold by this much a frame counts as silence; between the two it continues
# whatever it follows, so a region does not flicker on and off around one value (Silero's default).
_HYSTERESIS = 0.15


@dataclass(frozen=True)
class SpeechOptions:
    """What counts as speech. The first three are the fields of OpenAI's `server_vad` chunking
    strategy; the defaults are faster-whisper's for offline transcription, which keep a sentence's
    pauses inside one region so that Whisper sees whole sentences."""

    threshold: float = 0.5  # a frame with this speech probability or more is speech
    prefix_padding_ms: int = 400  # audio kept before (and after) each region: word onsets are soft
    silence_duration_ms: int = 2000  # a region ends after this much silence
    min_speech_duration_ms: int = 250  # shorter regions are clicks and coughs, dropped


@dataclass(frozen=True)
class SpeechRegion:
    start_sample: int
    end_sample: int

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end_sample / SAMPLE_RATE


def speech_regions(probabilities: np.ndarray, num_samples: int, options: SpeechOptions) -> list[SpeechRegion]:
    """Per-frame speech probabilities of ``num_samples`` of audio -> its speech regions, padded,
    merged where the padding makes them touch, in order."""
    speech_threshold = options.threshold
    silence_threshold = max(options.threshold - _HYSTERESIS, 0.01)
    min_silence_frames = max(1, round(options.silence_duration_ms * SAMPLE_RATE / 1000 / FRAME_SAMPLES))
    raw: list[tuple[int, int]] = []  # in frames, end exclusive
    start: int | None = None
    silence_since: int | None = None
    for frame, probability in enumerate(probabilities):
        if start is None:
            if probability >= speech_threshold:
                start, silence_since = frame, None
            continue
        if probability >= speech_threshold:
            silence_since = None
        elif probability < silence_threshold:
            silence_since = frame if silence_since is None else silence_since
            if frame + 1 - silence_since >= min_silence_frames:
                raw.append((start, silence_since))
                start = None
    if start is not None:
        raw.append((start, silence_since if silence_since is not None else len(probabilities)))

    min_speech = options.min_speech_duration_ms * SAMPLE_RATE / 1000
    pad = round(options.prefix_padding_ms * SAMPLE_RATE / 1000)
    regions: list[SpeechRegion] = []
    for first, end in raw:
        start_sample, end_sample = first * FRAME_SAMPLES, min(end * FRAME_SAMPLES, num_samples)
        if end_sample - start_sample < min_speech:
            continue
        start_sample, end_sample = max(0, start_sample - pad), min(num_samples, end_sample + pad)
        if regions and start_sample <= regions[-1].end_sample:
            start_sample = regions.pop().start_sample
        regions.append(SpeechRegion(start_sample, end_sample))
    return regions


def speech_probabilities(samples: np.ndarray) -> np.ndarray:
    """16 kHz float32 audio -> Silero VAD's speech probability for each 32 ms frame: the one pass
    that ``speech_regions`` turns into regions under any number of policies (a diarized request's
    transcription and its diarization read the same pass)."""
    return load_silero_vad().speech_probabilities(samples)


def detect_speech(samples: np.ndarray, options: SpeechOptions) -> list[SpeechRegion]:
    """16 kHz float32 audio -> its speech regions, by Silero VAD (benchmarks/bench_ingest.py times
    it)."""
    return speech_regions(speech_probabilities(samples), len(samples), options)


def speech_windows(samples: np.ndarray, regions: list[SpeechRegion]) -> list[AudioWindow]:
    """Windows of at most 30 s, each the audio of as many whole regions as fit, played one after
    another; the audio between regions is left out. A region longer than 30 s is cut at its
    quiet points, as audio without speech detection is. Each window keeps where its pieces lie in
    the file, so its timestamps map back to the file's timeline."""
    pieces: list[tuple[int, int]] = []  # (start, end) samples in the file
    for region in regions:
        if region.end_sample - region.start_sample <= N_SAMPLES:
            pieces.append((region.start_sample, region.end_sample))
            continue
        for window in split_windows(samples[region.start_sample : region.end_sample]):
            start = region.start_sample + window.start_sample
            pieces.append((start, start + len(window.samples)))
    windows: list[AudioWindow] = []
    packed: list[tuple[int, int]] = []
    for start, end in pieces:
        if packed and sum(e - s for s, e in packed) + end - start > N_SAMPLES:
            windows.append(_packed_window(samples, packed))
            packed = []
        packed.append((start, end))
    if packed:
        windows.append(_packed_window(samples, packed))
    return windows


def _packed_window(samples: np.ndarray, pieces: list[tuple[int, int]]) -> AudioWindow:
    offsets = np.cumsum([0] + [end - start for start, end in pieces[:-1]])
    return AudioWindow(
        start_sample=pieces[0][0],
        samples=np.concatenate([samples[start:end] for start, end in pieces]),
        piece_starts=tuple((int(offset), start) for offset, (start, _) in zip(offsets, pieces)),
    )
