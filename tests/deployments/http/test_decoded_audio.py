"""The decoded audio an ingress holds at once: a request waits for room that others give back,
is refused after its wait, and gives its samples back when their array is freed, however its
request ended. With a decoding process, room is taken before the samples cross over."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from deployments.http.decoded_audio import DecodedAudio
from engine.errors import NoRoomError
from engine.model.decode_processes import DecodeProcesses
from engine.model.ffmpeg import SAMPLE_RATE, decode_audio
from tests.support.speech import SPEECH_DIR


def test_a_request_waits_for_room_that_another_gives_back():
    budget = DecodedAudio(max_seconds=10, wait_s=5)
    budget.hold(8 * SAMPLE_RATE)
    threading.Timer(0.2, budget.release, [8 * SAMPLE_RATE]).start()
    started = time.monotonic()
    budget.hold(5 * SAMPLE_RATE)
    assert 0.15 < time.monotonic() - started < 4 and budget.held_s == 5


def test_a_request_is_refused_when_no_room_comes_within_its_wait():
    budget = DecodedAudio(max_seconds=10, wait_s=0.2)
    budget.hold(8 * SAMPLE_RATE)
    with pytest.raises(NoRoomError):
        budget.hold(5 * SAMPLE_RATE)
    assert budget.held_s == 8


def test_samples_are_given_back_when_their_array_and_every_view_of_it_are_freed():
    budget = DecodedAudio(max_seconds=10, wait_s=0)
    samples = np.zeros(4 * SAMPLE_RATE, np.float32)
    budget.hold(samples.size)
    budget.held_until_freed(samples, samples.size)
    window = samples[SAMPLE_RATE:]
    del samples
    gc.collect()
    assert budget.held_s == 4  # a window still refers to them
    del window
    gc.collect()
    assert budget.held_s == 0


def test_room_is_taken_before_the_samples_cross_and_a_refusal_leaves_the_pool_working():
    jfk = (SPEECH_DIR / "jfk.flac").read_bytes()
    expected = decode_audio(jfk)
    pool = DecodeProcesses(1)
    try:
        told: list[int] = []
        samples = pool.decode(jfk, hold=told.append)
        assert told == [expected.size] and np.array_equal(samples, expected)

        def refuse(count: int) -> None:
            raise NoRoomError("the decoded audio this replica holds", 0.0)

        (first,) = pool.pids
        with pytest.raises(NoRoomError):
            pool.decode(jfk, hold=refuse)
        assert pool.pids != [first]  # the worker held the refused samples: it is replaced
        assert np.array_equal(pool.decode(jfk), expected)
    finally:
        pool.close()
