"""Clustering window embeddings into speakers, within the caller's bounds."""

from __future__ import annotations

import numpy as np

from engine.diarize.clustering import cluster_speakers
from engine.diarize.segmentation import subsegments
from engine.diarize.turns import speaker_turns
from engine.model.audio import SAMPLE_RATE
from engine.transcribe.speech import SpeechRegion


def voices(counts: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Window embeddings of len(counts) voices, counts[i] windows each, in turns of 10 windows."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(counts), 192))
    truth = np.concatenate([np.full(count, voice) for voice, count in enumerate(counts)])
    truth = np.concatenate([truth[i::10] for i in range(10)]).reshape(-1)  # interleave the voices
    return centres[truth] + 0.3 * rng.normal(size=(len(truth), 192)), truth


def test_distinct_voices_are_found_and_numbered_in_order_of_appearance():
    embeddings, truth = voices([40, 40, 40])
    labels = cluster_speakers(embeddings)
    assert len(set(labels)) == 3
    assert labels[0] == 0
    first_seen = [int(np.argmax(labels == speaker)) for speaker in range(3)]
    assert first_seen == sorted(first_seen)
    # the same partition as the truth, whatever the numbering
    assert len({(int(a), int(b)) for a, b in zip(labels, truth)}) == 3


def test_max_speakers_caps_the_count_and_equal_bounds_fix_it():
    embeddings, _ = voices([40, 40, 40, 40])
    assert len(set(cluster_speakers(embeddings, max_speakers=2))) <= 2
    assert len(set(cluster_speakers(embeddings, min_speakers=3, max_speakers=3))) == 3


def test_windows_cover_every_region_and_turns_follow_the_labels():
    regions = [SpeechRegion(0, 4 * SAMPLE_RATE), SpeechRegion(6 * SAMPLE_RATE, 6 * SAMPLE_RATE + 8000)]
    windows = subsegments(regions)
    assert windows[0].start_sample == 0 and windows[-2].speech_end_sample == 4 * SAMPLE_RATE
    assert all(w.end_sample - w.start_sample == int(1.5 * SAMPLE_RATE) for w in windows)
    # the short region is embedded with the audio before it but speaks only for itself
    assert windows[-1].speech_start_sample == 6 * SAMPLE_RATE and windows[-1].start_sample < 6 * SAMPLE_RATE
    labels = np.array([0] * (len(windows) - 3) + [1, 1, 0])
    turns = speaker_turns(windows, labels)
    assert [turn.speaker for turn in turns] == [0, 1, 0]
    assert turns[0].end_s == turns[1].start_s  # a change inside a region is cut in one place
    assert (turns[2].start_s, turns[2].end_s) == (6.0, 6.5)
