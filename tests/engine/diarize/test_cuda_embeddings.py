"""CAM++ on a GPU embeds as on the CPU: the speaker count hangs on small differences between
embeddings (an eigen-gap of a nearest-neighbour graph), so the GPU path must compute in float32,
not TF32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.diarize import SpeakerEncoderOptions
from engine.diarize.clustering import cluster_speakers
from engine.diarize.embeddings import RecordingWindows, SpeakerEncoder
from engine.diarize.segmentation import diarization_regions, subsegments
from tests.support.conversations import standard_conversations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_embeddings_of_the_four_speaker_conversation_are_the_cpus_and_count_the_same_speakers():
    four = next(c for c in standard_conversations() if c.name == "four_speakers")
    recording = RecordingWindows(four.samples, subsegments(diarization_regions(four.samples)))
    (on_cpu,) = SpeakerEncoder(SpeakerEncoderOptions(device="cpu")).embed([recording])
    (on_cuda,) = SpeakerEncoder(SpeakerEncoderOptions(device="cuda")).embed([recording])
    relative = np.linalg.norm(on_cuda - on_cpu, axis=1) / np.linalg.norm(on_cpu, axis=1)
    assert relative.max() < 1e-4
    assert len(set(cluster_speakers(on_cuda))) == len(set(cluster_speakers(on_cpu))) == 4
