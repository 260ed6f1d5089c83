"""The offline Python API: many files in, transcripts out, through the same engine the server runs.

A new encoder batch is started whenever the decoder's queue runs low, so the decoder keeps a full
continuous batch while memory holds only a few batches of K/V. On a GPU the batch is encoded on its
own stream while the decoder keeps stepping (engine/encode/overlap.py).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Sequence, Union

import numpy as np

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.encode.overlap import OverlappedEncoder
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVTensor
from engine.model.audio import SAMPLE_RATE, decode_audio, load_audio_file
from engine.model.loading import LoadedModel, load_model
from engine.transcribe.speech import SpeechOptions, detect_speech, speech_windows
from engine.transcribe.windows import LongFormMode, Transcription, long_form_cursor
from engine.types import DecodeOptions, DecodeResult, FinishReason

AudioInput = Union[bytes, str, os.PathLike, np.ndarray]


def to_samples(audio: AudioInput) -> np.ndarray:
    """Any accepted input -> float32 mono 16 kHz samples (arrays are taken as already 16 kHz)."""
    if isinstance(audio, np.ndarray):
        return audio.astype(np.float32, copy=False)
    if isinstance(audio, (bytes, bytearray)):
        return decode_audio(bytes(audio))
    return load_audio_file(audio)


class Transcriber:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        encoder_batch_size: int = 8,
    ):
        """``encoder_batch_size``: most 30 s windows in one encoder forward."""
        self.loaded = loaded or load_model(config or EngineConfig())
        self.config = self.loaded.config
        self.encoder_batch_size = encoder_batch_size
        self.encoder = OverlappedEncoder(
            EncoderRunner(self.loaded, graph_batch_size=encoder_batch_size), project_cross_kv=True
        )
        self.decoder = DecoderEngine(self.loaded)

    def close(self) -> None:
        """Stop the encoder's worker thread (there is one on a GPU). Or use the transcriber as a
        context manager: ``with Transcriber() as transcriber: ...``."""
        self.encoder.close()

    def __enter__(self) -> "Transcriber":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def transcribe(
        self,
        inputs: Sequence[AudioInput],
        options: DecodeOptions = DecodeOptions(),
        long_form: LongFormMode = "parallel",
        speech: SpeechOptions | None = None,
    ) -> list[Transcription]:
        """``speech``: cut each file into windows packed from the speech Silero VAD finds in it,
        leaving the rest undecoded (parallel long-form only); None: cut at quiet points."""
        self.decoder.make_request(options, cross_source=None)  # fail fast on bad options
        cursors = []
        for audio in inputs:
            samples = to_samples(audio)
            windows = None if speech is None else speech_windows(samples, detect_speech(samples, speech))
            cursors.append(long_form_cursor(samples, options, long_form, windows))
        # Rounds of what the cursors hand out, the files' windows sharing batches: in parallel mode
        # one round of every window, in sequential mode each file's current window.
        while handed_out := [(cursor, pending) for cursor in cursors for pending in cursor.next_windows()]:
            results = self.run_windows(
                deque(
                    (key, pending.window.samples, pending.options)
                    for key, (_, pending) in enumerate(handed_out)
                )
            )
            for key, (cursor, pending) in enumerate(handed_out):
                cursor.accept(pending.window, results[key][0])
        return [cursor.transcription() for cursor in cursors]

    def run_windows(self, windows: deque) -> dict[int, list[DecodeResult]]:
        """windows: (key, samples, options); returns each key's results in window order."""
        order: dict[str, tuple[int, int]] = {}
        results: dict[int, dict[int, DecodeResult]] = {}
        batch_size = self.encoder_batch_size
        counter = 0
        encoding: list[tuple[int, np.ndarray, DecodeOptions]] = []  # the windows of the batch in flight
        while windows or encoding or self.decoder.has_work:
            if not encoding and windows and self.decoder.stats().num_waiting < batch_size:
                encoding = [windows.popleft() for _ in range(min(batch_size, len(windows)))]
                self.encoder.submit([samples for _, samples, _ in encoding])
            # With nothing to decode, wait for the batch; otherwise take it only once it is done.
            cross_kv = self.encoder.take(wait=not self.decoder.has_work) if encoding else None
            if cross_kv is not None:
                for (key, samples, options), request_kv in zip(encoding, cross_kv):
                    request = self.decoder.make_request(
                        options, CrossKVTensor(request_kv), audio_duration_s=len(samples) / SAMPLE_RATE
                    )
                    order[request.request_id] = (key, counter)
                    counter += 1
                    self.decoder.submit(request)
                encoding = []
            for result in self.decoder.step():
                if result.finish_reason == FinishReason.ERROR:
                    raise RuntimeError(f"decoding failed: {result.error}")
                key, position = order.pop(result.request_id)
                results.setdefault(key, {})[position] = result
        return {key: [by_position[p] for p in sorted(by_position)] for key, by_position in results.items()}
