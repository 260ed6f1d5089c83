"""Silero VAD: 16 kHz float32 samples -> a speech probability for every 32 ms frame.

The model is the ONNX export that the `silero-vad` wheel carries (MIT), run with onnxruntime, so
nothing is downloaded at run time. We use its "sequence" export, which takes a block of frames in
one call and returns the LSTM state after the block: the same numbers as the frame-at-a-time export
(the package checks them bit for bit) without a Python call per 32 ms, and with the state carried
by us, one ``SileroVAD`` serves any number of offline calls and streams at once.

What counts as speech (thresholds, minimum durations, padding) is policy, not the model's: it lives
in engine/transcribe/speech.py.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.model.audio import SAMPLE_RATE

FRAME_SAMPLES = 512  # the model's frame at 16 kHz: one probability per 32 ms
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE
CONTEXT_SAMPLES = 64  # each frame is fed with the previous frame's last 4 ms in front of it
_STATE_SHAPE = (1, 1, 128)  # the LSTM's hidden and cell state
# Frames per ONNX call: ~16 s of audio, a 1.2 MB input block; larger blocks do not run faster.
_FRAMES_PER_CALL = 512
_MODEL_FILE = "silero_vad_16k_sequence.onnx"


@dataclass
class VADStream:
    """One audio stream's place in the model: its LSTM state, the context the next frame is fed
    with, and samples that do not fill a frame yet. Made by ``SileroVAD.stream()``, fed with
    ``SileroVAD.feed``; one per stream, never shared between threads."""

    hidden: np.ndarray = field(default_factory=lambda: np.zeros(_STATE_SHAPE, dtype=np.float32))
    cell: np.ndarray = field(default_factory=lambda: np.zeros(_STATE_SHAPE, dtype=np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT_SAMPLES, dtype=np.float32))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    frames_done: int = 0  # frames given a probability so far; frame i covers [i * 32 ms, (i + 1) * 32 ms)

    @property
    def processed_s(self) -> float:
        """The stream time up to which every frame has a probability."""
        return self.frames_done * FRAME_S


class SileroVAD:
    """The Silero VAD model, loaded once (``load_silero_vad``). Thread-safe: all per-stream state is
    in the caller's ``VADStream``; onnxruntime sessions may be run from several threads at once."""

    def __init__(self, threads: int = 1):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # One thread per call: VAD runs beside the model, on threads of its own, and a second
        # intra-op thread buys little for a model this small (measured in benchmarks/bench_ingest.py).
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(_model_path()), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def speech_probabilities(self, samples: np.ndarray) -> np.ndarray:
        """A whole recording (float32, 16 kHz, mono) -> [ceil(n / 512)] probabilities; the last
        frame is padded with zeros."""
        stream = self.stream()
        probabilities = self.feed(stream, samples)
        return np.concatenate([probabilities, self.flush(stream)])

    def stream(self) -> VADStream:
        return VADStream()

    def feed(self, stream: VADStream, samples: np.ndarray) -> np.ndarray:
        """Feed the next samples of a stream (any length, 16 kHz float32); returns the probabilities
        of the frames they complete, in order (possibly none). Samples short of a frame are kept
        for the next call."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if stream.pending.size:
            samples = np.concatenate([stream.pending, samples])
        whole = samples.size - samples.size % FRAME_SAMPLES
        stream.pending = samples[whole:].copy()
        return self._run(stream, samples[:whole])

    def flush(self, stream: VADStream) -> np.ndarray:
        """The end of a stream: the pending samples, padded with zeros to a frame, get their
        probability (none when no samples are pending)."""
        if not stream.pending.size:
            return np.zeros(0, dtype=np.float32)
        frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
        frame[: stream.pending.size] = stream.pending
        stream.pending = np.zeros(0, dtype=np.float32)
        return self._run(stream, frame)

    def _run(self, stream: VADStream, samples: np.ndarray) -> np.ndarray:
        """Whole frames -> their probabilities, advancing the stream's state."""
        frames = samples.reshape(-1, FRAME_SAMPLES)
        if not len(frames):
            return np.zeros(0, dtype=np.float32)
        probabilities = []
        for first in range(0, len(frames), _FRAMES_PER_CALL):
            block = frames[first : first + _FRAMES_PER_CALL]
            contexts = np.empty((len(block), CONTEXT_SAMPLES), dtype=np.float32)
            contexts[0] = stream.context
            contexts[1:] = block[:-1, -CONTEXT_SAMPLES:]
            values, stream.hidden, stream.cell = self._session.run(
                ["speech_probs", "hn", "cn"],
                {"input": np.concatenate([contexts, block], axis=1), "h": stream.hidden, "c": stream.cell},
            )
            stream.context = block[-1, -CONTEXT_SAMPLES:].copy()
            probabilities.append(values.reshape(-1))
        stream.frames_done += len(frames)
        return np.concatenate(probabilities).astype(np.float32, copy=False)


def _model_path() -> Path:
    # Found, not imported: importing `silero_vad` imports torch and sets torch's thread count to 1
    # for the whole process, which would slow the encoder that shares it.
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("Silero VAD needs the `silero-vad` package: pip install silero-vad")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / _MODEL_FILE


@functools.lru_cache(maxsize=1)
def load_silero_vad() -> SileroVAD:
    """The process's one Silero VAD model, made on first use."""
    return SileroVAD()
