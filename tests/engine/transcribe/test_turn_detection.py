"""server_vad on Silero VAD: speech-set clips with silence between them, fed as a live stream in
small chunks, give one turn per clip, starting before it (prefix padding) and stopping after it."""

from __future__ import annotations

import numpy as np

from engine.model.audio import SAMPLE_RATE
from engine.model.vad import load_silero_vad
from engine.transcribe.evaluation import concatenate_clips
from engine.transcribe.turn_detection import IdleTimedOut, SpeechStarted, SpeechStopped, TurnDetector
from tests.support.speech import english_clips

CLIP_IDS = ["osr72_04", "tts_01", "osr72_08", "tts_11"]


def _turns(samples: np.ndarray, chunk_ms: int, **settings) -> list:
    detector = TurnDetector(load_silero_vad(), **settings)
    chunk = SAMPLE_RATE * chunk_ms // 1000
    return [
        event
        for start in range(0, len(samples), chunk)
        for event in detector.feed(samples[start : start + chunk])
    ]


def _speech() -> object:
    clips = {clip.id: clip for clip in english_clips()}
    lead = np.zeros(SAMPLE_RATE, dtype=np.float32)
    speech = concatenate_clips([clips[clip_id] for clip_id in CLIP_IDS], silence_s=1.5)
    return lead, speech


def test_each_utterance_is_one_turn_from_its_padded_start_to_its_end():
    lead, speech = _speech()
    samples = np.concatenate([lead, speech.samples])
    events = _turns(samples, chunk_ms=40, threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    assert [type(event) for event in events] == [SpeechStarted, SpeechStopped] * len(CLIP_IDS)
    lead_s = len(lead) / SAMPLE_RATE
    for index, (started, stopped) in enumerate(zip(events[::2], events[1::2])):
        clip_start_s, clip_end_s = lead_s + speech.clip_starts_s[index], lead_s + speech.clip_ends_s[index]
        # Clips carry some silence of their own at either end; Silero's frames are 32 ms.
        assert clip_start_s - 0.35 <= started.audio_start_s <= clip_start_s + 0.5, index
        assert clip_end_s - 0.6 <= stopped.audio_end_s <= clip_end_s + 0.1, index
        assert stopped.detected_s - stopped.audio_end_s >= 0.5, "stops only after silence_duration_ms"
        assert stopped.detected_s < clip_end_s + 0.7, "and not much later"


def test_the_turns_do_not_depend_on_how_the_stream_is_chunked():
    lead, speech = _speech()
    samples = np.concatenate([lead, speech.samples])
    settings = dict(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    assert _turns(samples, chunk_ms=20, **settings) == _turns(samples, chunk_ms=100, **settings)


def test_a_longer_silence_duration_joins_utterances_separated_by_a_shorter_pause():
    clips = {clip.id: clip for clip in english_clips()}
    speech = concatenate_clips([clips["osr72_04"], clips["tts_01"]], silence_s=0.6)
    samples = np.concatenate([np.zeros(SAMPLE_RATE, dtype=np.float32), speech.samples])
    short = _turns(samples, chunk_ms=40, threshold=0.5, prefix_padding_ms=300, silence_duration_ms=300)
    long = _turns(samples, chunk_ms=40, threshold=0.5, prefix_padding_ms=300, silence_duration_ms=1200)
    assert sum(isinstance(event, SpeechStarted) for event in short) == 2
    assert [type(event) for event in long] == [SpeechStarted], "still speaking: the pause was too short"


def test_silence_and_quiet_noise_start_no_turn():
    noise = np.random.default_rng(0).normal(0, 0.003, SAMPLE_RATE * 5).astype(np.float32)
    settings = dict(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    assert _turns(np.zeros(SAMPLE_RATE * 5, dtype=np.float32), 40, **settings) == []
    assert _turns(noise, 40, **settings) == []


IDLE_SETTINGS = dict(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500, idle_timeout_ms=1000)


def test_quiet_times_out_once_per_idle_timeout_of_audio_each_stretch_starting_where_the_last_ended():
    silence = np.zeros(int(SAMPLE_RATE * 3.5), dtype=np.float32)
    events = _turns(silence, 40, **IDLE_SETTINGS)
    assert [type(event) for event in events] == [IdleTimedOut] * 3
    assert events[0].audio_start_s == 0.0
    for before, after in zip(events, events[1:]):
        assert after.audio_start_s == before.audio_end_s, "stretches follow each other, none twice"
    for event in events:
        assert 1.0 <= event.audio_end_s - event.audio_start_s < 1.0 + 0.032  # to the next VAD frame
    assert _turns(silence, 1000, **IDLE_SETTINGS) == events, "audio time: chunking changes nothing"
    assert _turns(silence, 40, **{**IDLE_SETTINGS, "idle_timeout_ms": None}) == []


def test_speech_longer_than_the_idle_timeout_never_times_out_and_the_quiet_counts_from_its_end():
    clips = {clip.id: clip for clip in english_clips()}
    speech = concatenate_clips([clips["osr72_04"]], silence_s=1.6).samples
    samples = np.concatenate([np.zeros(SAMPLE_RATE // 2, dtype=np.float32), speech])
    events = _turns(samples, 40, **IDLE_SETTINGS)
    assert [type(event) for event in events] == [SpeechStarted, SpeechStopped, IdleTimedOut], events
    started, stopped, quiet = events
    assert stopped.audio_end_s - started.audio_start_s > 2.0, "a turn longer than the idle timeout"
    assert quiet.audio_start_s == stopped.detected_s
    assert 1.0 <= quiet.audio_end_s - quiet.audio_start_s < 1.0 + 0.032
