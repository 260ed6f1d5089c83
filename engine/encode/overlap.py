"""Encoding beside decoding, in one process: the encoder runs on a worker thread and, on a GPU, its
own CUDA stream, while the caller keeps stepping the decoder.

The two halves want different parts of the GPU: the encoder's batched matrix products are
compute-bound, a decode step's attention reads are memory-bound. Run one after the other on the
same stream (the plain loop), every encoder batch stalls decoding for its whole duration (a large
model's full batch takes a large fraction of a second). On separate streams the GPU can run their
kernels side by side.

Overlap is not always a gain: the decoder starts on the first batch and runs smaller batches while
the encoder, slowed by sharing the GPU, delivers the rest; the larger the decode batch the cache
allows, the more that costs: on a burst it can help a bf16 cache and cost an fp8 cache, which holds
twice the requests at once. Callers choose with ``overlap``.

Side by side, the encoder's stream outranks the decode loop's (engine.gpu.encoder_stream_first): as
SMs come free the GPU starts a forward's blocks before those of decode steps queued behind it. A
forward then ends sooner, its windows join the decode batch sooner, and the decoder runs more rows
a step for the same GPU time; decode steps wait a little while a forward runs.

A forward's large products are tiled over every SM, and a decode step's small kernels wait for SMs
to come free between its tiles, so beside a forward a decode step can take several times as long.
With ``engine.gpu.encoder_sm_share`` the encoder's stream belongs to a CUDA green context holding
that share of the SMs: the forward never holds the rest, and the decode steps, on the primary
context, use every SM while no forward runs.

The worker waits for its batch's kernels to finish before the batch counts as done, so a caller that
submits the states to the decoder only then never makes a decode step wait on the encoder. The
states were allocated on the encoder's stream: they are marked as used on the caller's stream too,
so the caching allocator does not hand their memory to the encoder again while decoder work that
reads them is still queued.

On a CPU nothing overlaps by default: the batch is encoded at submit time (intra-op threads already
use the cores; a second stream of work would only oversubscribe them). ``overlap=True`` still runs
it on the worker thread there, which is how the tests exercise the threaded path without a GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.cuda.green_contexts as green_contexts

from engine.encode.runner import EncoderRunner, Windows
from engine.kernels import sm_count


class OverlappedEncoder:
    """At most one encoder batch in flight; ``submit`` starts it, ``take`` collects it when done."""

    def __init__(self, runner: EncoderRunner, *, project_cross_kv: bool, overlap: bool | None = None):
        """A batch yields encoder states [N, frames, d], or with ``project_cross_kv`` each window's
        cross-attention K/V (``EncoderRunner.cross_kv``). ``overlap``: encode on the worker thread
        (default: on a GPU only); False encodes at submit time on the caller's stream."""
        self.runner = runner
        self.project_cross_kv = project_cross_kv
        self.overlaps = runner.device.type == "cuda" if overlap is None else overlap
        on_gpu = self.overlaps and runner.device.type == "cuda"
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder") if self.overlaps else None
        )
        self._green_context = None  # owns the partitioned stream's SMs; kept for the stream's life
        self._stream = self._encoder_stream(runner) if on_gpu else None
        self._consumer_stream = torch.cuda.current_stream(runner.device) if on_gpu else None
        self._in_flight: Future | None = None
        self.gpu_wait_s = 0.0  # encode_blocking's time waiting for its kernels, summed since start

    def _encoder_stream(self, runner: EncoderRunner) -> torch.cuda.Stream:
        if runner.sm_share is None:
            # A lower number is a higher priority; the decode loop's stream has the default, 0.
            return torch.cuda.Stream(device=runner.device, priority=-1 if runner.stream_first else 0)
        if not green_contexts.SUPPORTED:
            raise RuntimeError(
                "engine.gpu.encoder_sm_share needs CUDA green contexts, which this torch build lacks "
                "(a CUDA 12.4+ build); leave it unset"
            )
        index = runner.device.index if runner.device.index is not None else torch.cuda.current_device()
        self._green_context = green_contexts.GreenContext.create(
            num_sms=max(1, round(sm_count(runner.device) * runner.sm_share)), device_id=index
        )
        # A green context's stream has the default priority: with SMs of its own the encoder needs
        # no precedence over the decode steps' blocks (encoder_stream_first does not apply).
        return self._green_context.Stream()

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream the encoder runs on (None: the caller's)."""
        return self._stream

    @property
    def busy(self) -> bool:
        return self._in_flight is not None

    def submit(self, windows: Windows, frames: int | None = None) -> None:
        """Start encoding ``windows`` over ``frames`` encoder frames (None: a full window's)."""
        if self._in_flight is not None:
            raise RuntimeError("an encoder batch is already in flight: take() it first")
        if not self.overlaps:
            done: Future = Future()
            done.set_result(self._encode(windows, frames))
            self._in_flight = done
            return
        self._in_flight = self._worker.submit(self.encode_blocking, windows, frames)

    def take(self, wait: bool = False) -> torch.Tensor | None:
        """The in-flight batch's output once its kernels have finished (``wait``: block until then);
        None while it is still running or when nothing is in flight. Re-raises the batch's error."""
        if self._in_flight is None or not (wait or self._in_flight.done()):
            return None
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.result()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def encode_blocking(self, windows: Windows, frames: int | None = None) -> torch.Tensor:
        """Encode on the calling thread, on the encoder's stream where there is one, and return once
        the kernels have finished: for a caller that is itself a worker thread (a colocated
        replica's forwards, deployments/colocated_encoder.py)."""
        if self._stream is None:
            return self._encode(windows, frames)
        with torch.cuda.stream(self._stream):
            out = self._encode(windows, frames)
            finished = torch.cuda.Event()
            finished.record(self._stream)
        out.record_stream(self._consumer_stream)
        waiting_since = time.perf_counter()
        finished.synchronize()  # releases the GIL: the decoder loop runs meanwhile
        self.gpu_wait_s += time.perf_counter() - waiting_since
        return out

    def _encode(self, windows: Windows, frames: int | None) -> torch.Tensor:
        states = self.runner.encode(windows, frames)
        return self.runner.cross_kv(states) if self.project_cross_kv else states
