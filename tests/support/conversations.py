"""Multi-speaker conversations with known turns, built at test time from the speech set's clips.

Offline, distinct real voices are few: J. F. Kennedy (jfk), the Open Speech Repository reader
(osr72_*), and the two people of multilingual.flac (an English speaker for its first half, a German
one for its second). Two espeak-ng voices of the tts_* clips add synthetic speakers: en-us+f2 and
en-gb+m3 (the other espeak voices of the set are too close to en-gb+m3 for a speaker encoder to tell
apart; docs/diarization.md has the similarities). Each source is cut into utterances at its pauses
(by energy, so the reference owes nothing to the VAD under test), and a conversation is a seeded
random walk over speakers: each turn one to three utterances of one voice, turns separated by a pause or
overlapping the previous one's end, over a low noise floor. The reference turns come from the construction.

Deterministic: the same seed gives the same samples and turns, on any machine.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np

from engine.model.audio import SAMPLE_RATE, load_audio_file
from tests.support.speech import SPEECH_DIR

_FRAME = SAMPLE_RATE // 50  # 20 ms energy frames
_MIN_PAUSE_FRAMES = 15  # a pause of 0.3 s or more ends an utterance
_MULTILINGUAL_SPLIT_S = 30.0  # multilingual.flac: the English speaker before, the German one after


@dataclass(frozen=True)
class ReferenceTurn:
    """Who speaks when, as the construction placed it: one utterance, seconds from the start."""

    speaker: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Conversation:
    name: str
    samples: np.ndarray  # float32, 16 kHz, mono
    turns: list[ReferenceTurn]

    @property
    def duration_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    @property
    def speakers(self) -> list[str]:
        return sorted({turn.speaker for turn in self.turns})


@dataclass(frozen=True)
class StereoCall:
    """Two parties, one a channel: ``samples`` is [2, n], party ``speakers[c]`` on channel c."""

    samples: np.ndarray
    speakers: tuple[str, str]
    turns: list[ReferenceTurn]


def _manifest() -> list[dict]:
    lines = (SPEECH_DIR / "manifest.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _utterances(samples: np.ndarray) -> list[np.ndarray]:
    """A clip cut at its pauses, each piece trimmed to where its energy starts and stops. Silence is
    20 dB over the clip's own noise floor or 35 dB under its loudest frame, whichever is higher."""
    frames = len(samples) // _FRAME
    rms = np.sqrt(np.mean(samples[: frames * _FRAME].reshape(frames, _FRAME) ** 2, axis=1) + 1e-12)
    level_db = 20 * np.log10(rms)
    threshold_db = max(np.percentile(level_db, 5) + 20, level_db.max() - 35)
    voiced = level_db > threshold_db
    pieces: list[np.ndarray] = []
    start, last, quiet = None, 0, 0
    for frame, is_voiced in enumerate(voiced):
        if is_voiced:
            start, last, quiet = (frame if start is None else start), frame, 0
        elif start is not None:
            quiet += 1
            if quiet >= _MIN_PAUSE_FRAMES:
                pieces.append(samples[start * _FRAME : (last + 1) * _FRAME])
                start = None
    if start is not None:
        pieces.append(samples[start * _FRAME : (last + 1) * _FRAME])
    # Shorter than half a second is a breath or a click, not an utterance to attribute.
    return [piece for piece in pieces if len(piece) >= SAMPLE_RATE // 2]


@functools.lru_cache(maxsize=1)
def voices() -> dict[str, tuple[np.ndarray, ...]]:
    """Each distinct voice of the speech set -> its utterances."""
    clips: dict[str, list[str]] = {"jfk": [], "osr": [], "tts_f2": [], "tts_m3": []}
    for item in _manifest():
        source = item.get("source", "")
        if item["id"] == "jfk":
            clips["jfk"].append(item["audio"])
        elif item["id"].startswith("osr72_"):
            clips["osr"].append(item["audio"])
        elif "voice en-us+f2 " in source:
            clips["tts_f2"].append(item["audio"])
        elif "voice en-gb+m3 " in source:
            clips["tts_m3"].append(item["audio"])
    utterances = {
        name: tuple(piece for audio in files for piece in _utterances(load_audio_file(SPEECH_DIR / audio)))
        for name, files in clips.items()
    }
    multilingual = load_audio_file(SPEECH_DIR / "multilingual.flac")
    split = int(_MULTILINGUAL_SPLIT_S * SAMPLE_RATE)
    utterances["multi_en"] = tuple(_utterances(multilingual[:split]))
    utterances["multi_de"] = tuple(_utterances(multilingual[split:]))
    return utterances


def _placements(
    speakers: list[str], duration_s: float, seed: int, overlap_every: int
) -> list[tuple[str, np.ndarray, int]]:
    """(speaker, utterance, start sample) in order: a seeded walk over the speakers."""
    rng = np.random.default_rng(seed)
    queues: dict[str, list[np.ndarray]] = {name: [] for name in speakers}
    placements: list[tuple[str, np.ndarray, int]] = []
    cursor = int(0.5 * SAMPLE_RATE)
    speaker = speakers[0]
    turn_number = 0
    while cursor < duration_s * SAMPLE_RATE:
        for index in range(int(rng.integers(1, 4))):
            if not queues[speaker]:
                pool = voices()[speaker]
                queues[speaker] = [pool[i] for i in rng.permutation(len(pool))]
            utterance = queues[speaker].pop()
            if index:  # a breath between one speaker's sentences
                cursor += int(rng.uniform(0.2, 0.5) * SAMPLE_RATE)
            placements.append((speaker, utterance, cursor))
            cursor += len(utterance)
        turn_number += 1
        if turn_number % overlap_every == 0:  # the next speaker cuts in before this one ends
            cursor -= int(rng.uniform(0.3, 0.8) * SAMPLE_RATE)
        else:
            cursor += int(rng.uniform(0.4, 1.5) * SAMPLE_RATE)
        speaker = str(rng.choice([name for name in speakers if name != speaker]))
    return placements


def _mix(placements: list[tuple[str, np.ndarray, int]], channels: dict[str, int], seed: int) -> np.ndarray:
    length = max(start + len(utterance) for _, utterance, start in placements) + SAMPLE_RATE // 2
    # A room's noise floor, 40 dB under the speech, so no window is digital silence.
    noise = np.random.default_rng(seed).normal(0.0, 0.001, (max(channels.values()) + 1, length))
    mix = noise.astype(np.float32)
    for speaker, utterance, start in placements:
        # Each utterance at the same loudness: level differences would make the task easier.
        level = np.sqrt(np.mean(utterance**2)) + 1e-9
        mix[channels[speaker], start : start + len(utterance)] += utterance * (0.1 / level)
    peak = float(np.abs(mix).max())
    return mix * (0.95 / peak) if peak > 0.95 else mix


def _turns(placements: list[tuple[str, np.ndarray, int]]) -> list[ReferenceTurn]:
    return [
        ReferenceTurn(speaker, start / SAMPLE_RATE, (start + len(utterance)) / SAMPLE_RATE)
        for speaker, utterance, start in placements
    ]


def conversation(
    name: str, speakers: list[str], duration_s: float, seed: int, overlap_every: int = 4
) -> Conversation:
    """``speakers`` (names from ``voices()``) taking turns for about ``duration_s``, mono."""
    placements = _placements(speakers, duration_s, seed, overlap_every)
    return Conversation(
        name, _mix(placements, {speaker: 0 for speaker in speakers}, seed)[0], _turns(placements)
    )


def stereo_call(duration_s: float = 60.0, seed: int = 7) -> StereoCall:
    """An agent and a customer, one a channel, with the overlaps of a real call."""
    speakers = ("multi_en", "tts_m3")
    placements = _placements(list(speakers), duration_s, seed, overlap_every=3)
    return StereoCall(_mix(placements, {speakers[0]: 0, speakers[1]: 1}, seed), speakers, _turns(placements))


def standard_conversations() -> list[Conversation]:
    """The 2-, 3- and 4-speaker conversations the diarization tests and benchmark use."""
    return [
        conversation("two_speakers", ["jfk", "tts_f2"], 60.0, seed=2),
        conversation("three_speakers", ["osr", "multi_en", "tts_m3"], 90.0, seed=3),
        conversation("four_speakers", ["osr", "multi_en", "multi_de", "tts_f2"], 100.0, seed=4),
    ]
