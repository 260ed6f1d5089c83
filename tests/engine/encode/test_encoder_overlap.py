"""Encoding beside decoding (engine/encode/overlap.py): a batch run on the worker thread yields
what the encoder computes inline, one batch at a time, errors come back to the caller, and the
offline API transcribes the same text with the encoder overlapped as with it inline.

``overlap=True`` runs the real worker thread here on the CPU, without a CUDA stream. The stream
path runs on a GPU under benchmarks/bench_gpu.py's engine section; on an H100 its encoder states
were bit-identical to inline ones.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.encode.overlap import OverlappedEncoder
from engine.encode.runner import EncoderRunner
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions
from tests.support.speech import english_clips, short_english_clips, windows_of


def _windows(count: int) -> torch.Tensor:
    return windows_of([clip.path for clip in short_english_clips()[:count]])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_yields_what_the_encoder_computes_inline(tiny_en, overlap):
    runner = EncoderRunner(tiny_en)
    windows = _windows(2)
    expected = runner.cross_kv(runner.encode(windows))
    encoder = OverlappedEncoder(runner, project_cross_kv=True, overlap=overlap)
    try:
        assert not encoder.busy and encoder.take() is None
        encoder.submit(windows)
        assert encoder.busy
        with pytest.raises(RuntimeError, match="in flight"):
            encoder.submit(windows)  # one batch at a time: the caller bounds staged K/V
        out = encoder.take(wait=True)
        assert not encoder.busy and encoder.take() is None
        torch.testing.assert_close(out, expected)
    finally:
        encoder.close()


def test_an_encoder_error_reaches_the_caller_and_the_encoder_stays_usable(tiny_en):
    runner = EncoderRunner(tiny_en)
    encoder = OverlappedEncoder(runner, project_cross_kv=False, overlap=True)
    try:
        encoder.submit(torch.zeros(1, 7))  # not a 30 s window: the mel front end's shapes fail
        with pytest.raises(RuntimeError):
            encoder.take(wait=True)
        assert not encoder.busy
        encoder.submit(_windows(1))
        torch.testing.assert_close(encoder.take(wait=True), runner.encode(_windows(1)))
    finally:
        encoder.close()


@pytest.mark.slow
def test_the_offline_api_transcribes_the_same_with_the_encoder_overlapped(tiny_en):
    paths = [clip.path for clip in english_clips()[:6]]
    options = DecodeOptions()
    inline = Transcriber(loaded=tiny_en)
    inline.encoder = OverlappedEncoder(inline.encoder.runner, project_cross_kv=True, overlap=False)
    overlapped = Transcriber(loaded=tiny_en)
    overlapped.encoder = OverlappedEncoder(overlapped.encoder.runner, project_cross_kv=True, overlap=True)
    overlapped.encoder_batch_size = 2  # several batches in flight in turn
    inline.encoder_batch_size = 2
    with overlapped:
        expected = [t.text for t in inline.transcribe(paths, options)]
        assert [t.text for t in overlapped.transcribe(paths, options)] == expected
        assert all(expected)
        assert any(thread.name.startswith("encoder") for thread in threading.enumerate())
    # Leaving the block stopped the encoder's worker thread.
    assert not any(thread.name.startswith("encoder") for thread in threading.enumerate())
