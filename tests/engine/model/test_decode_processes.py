"""Uploads decoded in worker processes: the same samples and refusals as decoding in process, and a
worker that dies fails the one upload it held while the pool goes on with a new worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.errors import AudioDecodeError, AudioTooLongError
from engine.model.decode_processes import DecodeProcesses
from engine.model.ffmpeg import SAMPLE_RATE, decode_audio
from tests.support.encoding import UploadFormat, encode_channels
from tests.support.speech import SPEECH_DIR

JFK = (SPEECH_DIR / "jfk.flac").read_bytes()


@pytest.fixture()
def pool():
    processes = DecodeProcesses(2)
    yield processes
    processes.close()


def test_a_worker_gives_the_samples_decoding_in_process_gives(pool):
    np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
    channels = np.zeros((8, SAMPLE_RATE), np.float32)
    channels[3] = decode_audio(JFK)[:SAMPLE_RATE]
    m4a_7_1 = encode_channels(channels, UploadFormat("m4a", "m4a", "ipod", "aac", "fltp", 48000), "7.1")
    np.testing.assert_array_equal(pool.decode(m4a_7_1), decode_audio(m4a_7_1))


def test_refusals_cross_from_the_worker_as_their_own_types(pool):
    with pytest.raises(AudioTooLongError, match="accepts at most 5 s") as too_long:
        pool.decode(JFK, max_duration_s=5)
    assert too_long.value.claimed and too_long.value.max_duration_s == 5
    with pytest.raises(AudioDecodeError, match="no audio format FFmpeg reads"):
        pool.decode(b"not audio at all" * 64)
    with pytest.raises(AudioDecodeError, match="the audio file is empty"):
        pool.decode(b"")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_worker_that_faults_mid_decode_fails_that_upload_alone_and_is_replaced():
    pool = DecodeProcesses(1)
    try:
        (doomed,) = pool.pids
        # Stopped, the worker takes the upload but cannot answer; the fault lands while it holds it.
        os.kill(doomed, signal.SIGSTOP)
        while _state(doomed) != "T":
            time.sleep(0.01)
        outcome: dict[str, object] = {}

        def decode() -> None:
            try:
                outcome["samples"] = pool.decode(JFK)
            except Exception as error:
                outcome["error"] = error

        caller = threading.Thread(target=decode)
        caller.start()
        time.sleep(0.2)
        os.kill(doomed, signal.SIGSEGV)
        os.kill(doomed, signal.SIGCONT)
        caller.join(timeout=30)
        assert isinstance(outcome.get("error"), AudioDecodeError), outcome
        assert "crashed the decoder (signal SIGSEGV)" in str(outcome["error"])
        assert pool.pids != [doomed]
        np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
    finally:
        pool.close()


def test_a_worker_killed_while_idle_is_replaced_without_failing_the_next_upload():
    pool = DecodeProcesses(1)
    try:
        (killed,) = pool.pids
        os.kill(killed, signal.SIGKILL)
        while _state(killed) != "Z":  # dead, not yet reaped
            time.sleep(0.01)
        np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
        assert pool.pids != [killed]
    finally:
        pool.close()
