"""Uploads decoded in worker processes: the same samples and refusals as decoding in process, and a
worker that dies fails the one upload it held while the pool goes on with a new worker."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from engine.errors import AudioDecodeError, AudioTooLongError, NoRoomError
from engine.model.decode_processes import DecodeProcesses
from engine.model.ffmpeg import SAMPLE_RATE, decode_audio, decode_audio_channels
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


def _wav_claiming_one_hertz(duration_s: int) -> bytes:
    """Silence whose header says 1 sample a second: a few KB that decode into ``duration_s`` of
    16 kHz samples."""
    data = np.zeros(duration_s, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16)
    chunks = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def test_a_long_file_crosses_in_batches_and_the_worker_gives_its_memory_back():
    pool = DecodeProcesses(1)
    try:
        worker = psutil.Process(pool.pids[0])
        np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
        idle_bytes = worker.memory_info().rss
        samples = pool.decode(_wav_claiming_one_hertz(600))  # ten minutes: 38 MB of samples
        assert samples.shape == (600 * SAMPLE_RATE,) and not samples.any()
        time.sleep(0.2)  # the worker frees them after the last batch has gone
        assert worker.memory_info().rss - idle_bytes < 10 * 2**20
        # The exchange is still in step: the next upload gets its own samples.
        np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
    finally:
        pool.close()


def test_an_upload_waits_for_an_idle_worker_at_most_the_pools_wait():
    pool = DecodeProcesses(1, wait_s=0.2)
    release = threading.Event()
    holder = threading.Thread(target=lambda: pool.decode(JFK, hold=lambda _: release.wait()))
    holder.start()
    try:
        time.sleep(0.2)  # the holder has the one worker
        started = time.monotonic()
        with pytest.raises(NoRoomError):
            pool.decode(JFK)
        assert 0.2 <= time.monotonic() - started < 2
    finally:
        release.set()
        holder.join()
    np.testing.assert_array_equal(pool.decode(JFK), decode_audio(JFK))
    pool.close()


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


def test_split_channels_cross_from_a_worker_as_decoding_them_in_process_gives(pool):
    """channels=split: each channel kept apart, [channels, samples], the same as in process, with
    every channel's samples counted for the replica's hold."""
    speech = decode_audio(JFK)[: 2 * SAMPLE_RATE]
    stereo = np.stack([speech, np.zeros_like(speech)])
    upload = encode_channels(
        stereo, UploadFormat("wav", "wav", "wav", "pcm_f32le", "flt", SAMPLE_RATE), "stereo"
    )
    held = []
    channels = pool.decode(upload, hold=held.append, split_channels=True)
    assert channels.shape == (2, speech.size) and channels.flags.c_contiguous
    np.testing.assert_array_equal(channels, decode_audio_channels(upload))
    np.testing.assert_allclose(channels[0], speech, atol=1e-6)
    assert not channels[1].any()
    assert held == [2 * speech.size]
    # Mixed, the same file is the mean of its channels, as before.
    np.testing.assert_allclose(pool.decode(upload), channels.mean(axis=0), atol=1e-6)
