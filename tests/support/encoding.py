"""Audio made into the files users upload, with FFmpeg's encoders through PyAV: every format
OpenAI's API accepts, and a few broken files."""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass

import av
import numpy as np

from engine.model.audio import SAMPLE_RATE


@dataclass(frozen=True)
class UploadFormat:
    name: str  # what the test calls it
    extension: str  # the upload's file name ends with it
    container: str  # FFmpeg's muxer
    codec: str
    sample_format: str
    rate: int
    channels: int = 1


# Each container OpenAI's API names (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm) with the
# codec its users' files carry, at the rates browsers, phones and editors record at.
UPLOAD_FORMATS = [
    UploadFormat("webm-opus", "webm", "webm", "libopus", "s16", 48000),
    UploadFormat("m4a-aac", "m4a", "ipod", "aac", "fltp", 44100, 2),
    UploadFormat("mp4-aac", "mp4", "mp4", "aac", "fltp", 48000),
    UploadFormat("mp3", "mp3", "mp3", "libmp3lame", "fltp", 44100),
    UploadFormat("mpga", "mpga", "mp3", "libmp3lame", "fltp", 22050),
    UploadFormat("ogg-vorbis", "ogg", "ogg", "vorbis", "fltp", 44100, 2),
    UploadFormat("ogg-opus", "ogg", "ogg", "libopus", "s16", 48000),
    UploadFormat("wav-8bit", "wav", "wav", "pcm_u8", "u8", 16000),
    UploadFormat("wav-16bit", "wav", "wav", "pcm_s16le", "s16", 16000),
    UploadFormat("wav-24bit", "wav", "wav", "pcm_s24le", "s32", 48000),
    UploadFormat("wav-float", "wav", "wav", "pcm_f32le", "flt", 44100, 2),
    UploadFormat("flac", "flac", "flac", "flac", "s16", 16000),
    UploadFormat("mpeg", "mpeg", "mpeg", "mp2", "s16", 44100, 2),
]


@dataclass(frozen=True)
class ChannelLayoutUpload:
    name: str
    upload: UploadFormat
    layout: str  # FFmpeg's name: "7.1", or "64C" for 64 channels in no named order


# Files of many channels, as films and broadcast archives carry them: the layouts that once crashed
# the server (PyAV could not read a planar frame of 8 or more channels).
MANY_CHANNEL_UPLOADS = [
    ChannelLayoutUpload("wav-7.1", UploadFormat("wav", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE), "7.1"),
    ChannelLayoutUpload("flac-7.1", UploadFormat("flac", "flac", "flac", "flac", "s16", SAMPLE_RATE), "7.1"),
    ChannelLayoutUpload("m4a-aac-7.1", UploadFormat("m4a", "m4a", "ipod", "aac", "fltp", 48000), "7.1"),
    ChannelLayoutUpload(
        "wav-64-channels", UploadFormat("wav", "wav", "wav", "pcm_s16le", "s16", SAMPLE_RATE), "64C"
    ),
]


def in_every_channel(samples: np.ndarray, case: ChannelLayoutUpload) -> bytes:
    """Mono ``samples`` (16 kHz) copied into every channel of ``case``'s layout, as its file."""
    channels = np.repeat(samples[None], av.AudioLayout(case.layout).nb_channels, axis=0)
    return encode_channels(channels, case.upload, case.layout)


def encode(samples: np.ndarray, upload: UploadFormat, rate: int = SAMPLE_RATE) -> bytes:
    """Mono float32 samples at ``rate`` -> the bytes of a file in ``upload``'s format."""
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples, dtype=np.float32)[None], format="flt", layout="mono"
    )
    frame.sample_rate = rate
    return _written(frame, upload, "stereo" if upload.channels == 2 else "mono")


def encode_channels(
    channels: np.ndarray, upload: UploadFormat, layout: str, rate: int = SAMPLE_RATE
) -> bytes:
    """[channels, samples] float32 at ``rate`` -> a file in ``upload``'s format with ``layout`` (a
    name FFmpeg parses: "7.1", "octagonal", "64C" for 64 channels in no named order), each channel
    kept as given."""
    assert channels.shape[0] == av.AudioLayout(layout).nb_channels
    # Packed (interleaved), so that PyAV never walks the planes of a frame of many channels.
    interleaved = np.ascontiguousarray(channels.T, dtype=np.float32).reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(interleaved, format="flt", layout=layout)
    frame.sample_rate = rate
    return _written(frame, upload, layout)


def _written(frame: av.AudioFrame, upload: UploadFormat, layout: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=upload.container) as container:
        stream = container.add_stream(upload.codec, rate=upload.rate, layout=layout)
        if upload.codec == "vorbis":
            stream.codec_context.options = {"strict": "experimental"}  # FFmpeg's own vorbis encoder
        resampler = av.AudioResampler(format=upload.sample_format, layout=layout, rate=upload.rate)
        for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
            chunk.pts = None
            for packet in stream.encode(chunk):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def video_only_mp4(seconds: float = 1.0) -> bytes:
    """An mp4 with a short video stream and no audio stream."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for index in range(int(seconds * 10)):
            image = np.full((48, 64, 3), index * 20 % 255, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def flac_claiming(total_samples: int, samples: np.ndarray) -> bytes:
    """A 16 kHz flac holding ``samples`` whose header (STREAMINFO) says it holds ``total_samples``
    (0: the header does not say)."""
    data = bytearray(encode(samples, UploadFormat("flac", "flac", "flac", "flac", "s16", SAMPLE_RATE)))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "STREAMINFO comes first"
    # STREAMINFO's 64 bits after its block and frame sizes: rate (20), channels - 1 (3),
    # bits per sample - 1 (5), total samples (36).
    (packed,) = struct.unpack(">Q", data[18:26])
    packed = (packed & ~((1 << 36) - 1)) | total_samples
    data[18:26] = struct.pack(">Q", packed)
    return bytes(data)


def zip_archive() -> bytes:
    """A zip archive (as a user might rename to .webm by mistake)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", "meeting notes, not audio\n" * 100)
    return buffer.getvalue()
