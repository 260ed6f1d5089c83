"""Uploads decoded in a few worker processes, so that a fault inside FFmpeg or PyAV (native code,
fed bytes from anyone) ends one worker and fails one request, not the server replica around it.

The shape weighs three costs. Decoding in the replica's own process costs nothing extra but lets
a segmentation fault take down every request and live session on the replica. A new process per
request pays an interpreter start and the imports of numpy and PyAV each time, many times what
decoding a short clip costs (benchmarks/bench_ingest.py measures decoding). A small pool of
persistent processes pays that start once and, per request, only two copies through a pipe (the
upload in, the samples out), which run at memory speed, well under what decoding the same audio
takes (benchmarks/bench_decode_processes.py measures the three). A worker that dies is replaced,
and only the request it was decoding fails.

Memory: a worker holds one file's samples, as the decoder's short pieces, and sends them in
batches, dropping each as it goes, so it never holds two copies of a file; the parent writes them
into one array of the file's length. A request waits for an idle worker at most ``wait_s``.

Run as ``python -m engine.model.decode_processes <fd>``, this module is a worker: it decodes what
arrives on the connection at file descriptor ``fd`` until the connection closes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

import numpy as np

from engine.errors import AudioDecodeError, EngineError, NoRoomError

logger = logging.getLogger(__name__)

# The directory that holds the `engine` package, for the worker's import path.
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# Samples per message from a worker: large enough that a message's own cost is lost in its copy,
# small enough that joining a batch's pieces costs the worker no memory worth counting.
_BATCH_SAMPLES = 2**18


@dataclass(frozen=True)
class DecodeJob:
    """What the parent sends before the upload's bytes."""

    max_duration_s: float | None
    split_channels: bool = False


@dataclass(frozen=True)
class DecodeReply:
    """What a worker answers: the sample count of the float32 samples that follow as raw bytes, or
    the error decoding raised (then no bytes follow): an engine error is a refusal in words, the
    client's to read; any other a fault of the server's, a RuntimeError that names it."""

    sample_count: int = 0  # every channel's samples, with split channels
    error: Exception | None = None
    channels: int = 1  # split channels: the samples follow channel by channel


class _Worker:
    """One decoding process and the parent's end of its connection."""

    def __init__(self):
        parent_end, child_end = Pipe(duplex=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PROJECT_ROOT, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.model.decode_processes", str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_end.close()  # the worker's end lives in the worker: its death is then an EOF here
        self.connection = parent_end

    def decode(
        self,
        data: bytes,
        max_duration_s: float | None,
        hold: Callable[[int], None] | None,
        split_channels: bool = False,
    ) -> tuple[DecodeReply, np.ndarray]:
        """The worker's reply and the samples it sent ([channels, samples] when split). Raises
        EOFError (or OSError) when the worker dies before it has answered."""
        self.connection.send(DecodeJob(max_duration_s, split_channels))
        self.connection.send_bytes(data)
        reply: DecodeReply = self.connection.recv()
        if hold is not None and reply.error is None:
            hold(reply.sample_count)
        shape = (
            (reply.channels, reply.sample_count // reply.channels) if split_channels else reply.sample_count
        )
        samples = np.empty(shape, dtype=np.float32)
        flat = samples.reshape(-1)  # a view: the bytes land in ``samples``
        received_bytes = 0
        while received_bytes < samples.nbytes:  # the batches, each written where it belongs
            received_bytes += self.connection.recv_bytes_into(flat, received_bytes)
        return reply, samples

    def death(self) -> str:
        """How the worker ended, in words (it has ended, or is ending, when this is asked)."""
        self.connection.close()
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it answered nonsense and lives on: end it
            self.process.kill()
            code = self.process.wait()
        if code < 0:
            return f"signal {signal.Signals(-code).name}"
        return f"exit status {code}"

    def kill(self) -> None:
        self.connection.close()
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        self.connection.close()  # the worker reads an EOF and exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class DecodeProcesses:
    """``processes`` persistent workers; ``decode`` takes an idle one (waiting up to ``wait_s`` for
    one when all are busy, then raising NoRoomError; None: as long as it takes), so at most
    ``processes`` uploads decode at once."""

    def __init__(self, processes: int, wait_s: float | None = None):
        self.wait_s = wait_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers = [_Worker() for _ in range(processes)]
        for worker in self._workers:
            self._idle.put(worker)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, as ps lists them beside the replica's."""
        return [worker.process.pid for worker in self._workers]

    def decode(
        self,
        data: bytes,
        max_duration_s: float | None = None,
        hold: Callable[[int], None] | None = None,
        split_channels: bool = False,
    ) -> np.ndarray:
        """As engine.model.ffmpeg.decode_audio (with ``split_channels``, decode_audio_channels), in a
        worker. Raises AudioDecodeError too when the worker dies on this upload; another worker
        takes its place.

        ``hold`` is called with the number of samples once the worker has them and before they
        cross into this process: it may wait for room for them, or raise to refuse them (the worker,
        which still holds them, is then replaced)."""
        try:
            worker = self._idle.get(timeout=self.wait_s)
        except queue.Empty:
            raise NoRoomError("the audio decoding processes", self.wait_s) from None
        if (
            worker.process.poll() is not None
        ):  # died while idle (killed from outside): not this upload's doing
            logger.warning("a decoding process died (%s) while idle; starting another", worker.death())
            worker = self._replaced(worker)
        try:
            reply, samples = worker.decode(data, max_duration_s, hold, split_channels)
        except (EOFError, OSError):
            death = worker.death()
            logger.warning("a decoding process died (%s) on an upload; starting another", death)
            worker = self._replaced(worker)
            raise AudioDecodeError(
                f"could not decode audio: decoding it crashed the decoder ({death}); the file is "
                "corrupt or in a form this server cannot read"
            ) from None
        except BaseException:  # cut off mid-exchange (a refusal by hold, an interrupt): start afresh
            worker.kill()
            worker = self._replaced(worker)
            raise
        finally:
            self._idle.put(worker)
        if reply.error is not None:
            raise reply.error
        return samples

    def _replaced(self, dead: _Worker) -> _Worker:
        self._workers.remove(dead)
        worker = _Worker()
        self._workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self._workers.clear()


def _serve(connection: Connection) -> None:
    from engine.model.ffmpeg import decode_audio_pieces

    while True:
        try:
            job: DecodeJob = connection.recv()
            data = connection.recv_bytes()
        except EOFError:  # the parent closed the pool, or died
            return
        try:
            pieces = decode_audio_pieces(data, job.max_duration_s, job.split_channels)
        except EngineError as error:
            connection.send(DecodeReply(error=error))
            continue
        except Exception as error:
            traceback.print_exc()  # to the worker's stderr, which is the replica's log
            failure = RuntimeError(f"decoding failed unexpectedly: {type(error).__name__}: {error}")
            connection.send(DecodeReply(error=failure))
            continue
        if not job.split_channels:
            connection.send(DecodeReply(sample_count=sum(piece.size for piece in pieces)))
            _send_samples(connection, pieces)
        else:
            # Channel by channel, so that the parent's array is [channels, samples] as it lands.
            channels = pieces[0].shape[1] if pieces else 1
            connection.send(
                DecodeReply(sample_count=sum(p.shape[0] for p in pieces) * channels, channels=channels)
            )
            for channel in range(channels):
                _send_samples(connection, [np.ascontiguousarray(piece[:, channel]) for piece in pieces])
            pieces.clear()
        _return_freed_memory()


def _send_samples(connection: Connection, pieces: list[np.ndarray | None]) -> None:
    """``pieces``' samples in batches of about _BATCH_SAMPLES, never an empty one (the parent reads
    until it has the count it was told), each piece dropped from the list as it joins a batch, so
    what was sent is freed while the rest goes."""
    batch: list[np.ndarray] = []
    batch_samples = 0
    for index, piece in enumerate(pieces):
        pieces[index] = None
        batch.append(piece)
        batch_samples += piece.size
        last = index == len(pieces) - 1
        if batch_samples and (batch_samples >= _BATCH_SAMPLES or last):
            connection.send_bytes(memoryview(np.concatenate(batch)))
            batch.clear()
            batch_samples = 0


def _return_freed_memory() -> None:
    """Give the pages of a file's freed samples back to the system. They were many small arrays
    from the C heap, which glibc returns only from its top on its own: one live allocation above
    them would keep a worker at its largest file's size while it sits idle."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: its allocator decides
        pass


if __name__ == "__main__":
    # Ctrl-C in a terminal reaches the whole process group: the parent decides what it ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Through the module's importable name: what the worker pickles must name classes the parent
    # can find (engine.model.decode_processes.DecodeReply, not __main__.DecodeReply).
    from engine.model import decode_processes

    decode_processes._serve(Connection(int(sys.argv[1])))
