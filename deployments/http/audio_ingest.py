"""An upload -> its samples and, with speech detection on, its windows: decoded out of the
replica's process (engine.model.decode_processes), held within the replica's bound on decoded
audio (decoded_audio.py), and cut at speech by one Silero pass, whose probabilities a diarized
request's diarizer reads too rather than running the model over the same audio again.

Every call here blocks: run it on a worker thread (asyncio.to_thread), never on the event loop.
Decoding waits on a decoding process and onnxruntime releases the GIL while it works, so the
ingress keeps routing other requests' windows meanwhile. Speech detection belongs here, before the
encoder, because it decides which windows exist at all: it must see the whole file once (an
encoder sees one 30 s window and would cut regions at its edges), and a stretch it rules out is
never sent, encoded or decoded. It is cheap for that place: a small share of what the encoder and
decoder spend on the same audio (benchmarks/bench_ingest.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deployments.http.channels import check_channel_count
from deployments.http.decoded_audio import DecodedAudio
from deployments.http_limits import HTTPLimits
from engine import (
    AudioWindow,
    DecodeProcesses,
    SpeechOptions,
    speech_probabilities,
    speech_regions,
    speech_windows,
)


@dataclass(frozen=True)
class IngestedAudio:
    samples: np.ndarray  # 16 kHz float32, one channel
    windows: list[AudioWindow] | None  # with speech detection on: packed from its speech
    vad_pass: np.ndarray | None  # Silero's per-frame speech probabilities the windows came from


class AudioIngest:
    def __init__(self, http: HTTPLimits):
        self.max_audio_duration_s = http.max_audio_duration_s
        # Uploads are decoded out of this process: a file that faults FFmpeg must not end the replica.
        self.decoder = DecodeProcesses(http.decode_processes, http.decoded_audio_wait_s)
        self.decoded_audio = DecodedAudio(http.max_decoded_audio_s, http.decoded_audio_wait_s)

    def mono(self, data: bytes, speech: SpeechOptions | None) -> IngestedAudio:
        """The upload mixed to mono (as OpenAI's API takes it), and its windows from its speech."""
        # Decoding stops as soon as the audio passes the limit (413), before it fills memory.
        samples = self.decoded_audio.decoded(self.decoder.decode, data, self.max_audio_duration_s)
        return _with_speech(samples, speech)

    def channels(self, data: bytes, speech: SpeechOptions | None) -> list[IngestedAudio]:
        """channels=split: each channel of the upload (rows of one held array), each with the
        windows of its own speech."""
        samples = self.decoded_audio.decoded(
            self.decoder.decode, data, self.max_audio_duration_s, split_channels=True
        )
        check_channel_count(samples.shape[0])
        return [_with_speech(channel, speech) for channel in samples]


def _with_speech(samples: np.ndarray, speech: SpeechOptions | None) -> IngestedAudio:
    if speech is None:
        return IngestedAudio(samples, None, None)
    vad_pass = speech_probabilities(samples)
    windows = speech_windows(samples, speech_regions(vad_pass, len(samples), speech))
    return IngestedAudio(samples, windows, vad_pass)
