"""Encoded audio -> float32 mono 16 kHz samples, with FFmpeg's demuxers, decoders and resampler
(through PyAV, whose wheel carries FFmpeg's libraries).

Every container and codec FFmpeg reads is accepted, which covers each format OpenAI's API takes
(flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm). Decoding is incremental: the samples are counted
as they come out of the decoder, so a file longer than the caller allows is refused early and a
compressed file cannot expand into unbounded memory.
"""

from __future__ import annotations

import io
import math
import os

import av
import numpy as np

from engine.errors import AudioDecodeError, AudioTooLongError

SAMPLE_RATE = 16000
# The resampler keeps the channels and we mix them to mono as their mean, as librosa and
# transformers do for Whisper; FFmpeg's own downmix weighs each channel by 1/sqrt(2), a louder mix
# that the log-mel would see as a shift. Its output is packed (interleaved) float, never planar:
# PyAV finds a planar frame's planes by walking FFmpeg's channel pointers to the first null, and
# a frame of 8 or more channels has none after its last, so reading one (to_ndarray) reads past
# the array and faults. A packed frame has a single plane whatever its channel count.
_PACKED_FLOAT = "flt"
# The largest sample magnitude taken. Float audio's full scale is 1.0 and a file past it holds
# overs of a few dB; the one honest source of larger values is integer PCM stored as floats
# unscaled, which peaks at 2**15 (16-bit) and still transcribes. Anything larger is no recording
# (the log-mel's power would overflow float32 not far above it): it is refused as bad audio, not
# scaled down, because a single absurd sample would scale real speech beside it into silence.
MAX_SAMPLE_MAGNITUDE = 2.0**15
# libswresample's channel limit (SWR_CH_MAX): a file with more is refused before it reaches it.
MAX_CHANNELS = 64


def decode_audio(data: bytes, max_duration_s: float | None = None) -> np.ndarray:
    """Any container and codec FFmpeg reads -> float32 mono samples at 16 kHz, from the file's
    first audio stream: ``decode_audio_pieces``, joined."""
    pieces = decode_audio_pieces(data, max_duration_s)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def decode_audio_channels(data: bytes, max_duration_s: float | None = None) -> np.ndarray:
    """As ``decode_audio``, each channel kept apart: [channels, samples] float32 at 16 kHz, for a
    request that transcribes each channel on its own (a stereo call, one party a channel)."""
    pieces = decode_audio_pieces(data, max_duration_s, split_channels=True)
    if not pieces:
        return np.zeros((1, 0), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(pieces).T)


def decode_audio_pieces(
    data: bytes, max_duration_s: float | None = None, split_channels: bool = False
) -> list[np.ndarray]:
    """``data``'s samples (float32, mono, 16 kHz) as the decoder gave them, a short array per
    frame, in order: a caller that passes them on (engine/model/decode_processes.py) never needs
    room for a second copy of the whole file, as joining them would. ``split_channels``: each piece
    is [samples, channels] instead, the channels as the file has them (a stream whose channel
    count changes on the way cannot be split, and is refused).

    ``max_duration_s`` bounds the work and memory: a file whose header claims more audio, or that
    decodes into more, raises AudioTooLongError as soon as that is known, not after decoding it
    all. Raises AudioDecodeError, with a message in words, for empty input, bytes that are not
    audio, a container without audio, a corrupt stream or non-finite samples; an audio stream
    with no samples is valid and gives no pieces.
    """
    if not data:
        raise AudioDecodeError("the audio file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as error:
        raise AudioDecodeError(
            f"could not decode audio: the file is truncated, corrupt or in no audio format FFmpeg "
            f"reads ({_reason(error)})"
        ) from None
    with container:
        if not container.streams.audio:
            kinds = sorted({stream.type for stream in container.streams})
            found = f" (it holds {', '.join(kinds)} only)" if kinds else ""
            raise AudioDecodeError(f"could not decode audio: the file has no audio stream{found}")
        stream = container.streams.audio[0]
        if max_duration_s is not None:
            claimed_s = _claimed_duration_s(container, stream)
            if claimed_s is not None and claimed_s > max_duration_s:
                raise AudioTooLongError(claimed_s, max_duration_s, claimed=True)
        max_samples = None if max_duration_s is None else math.floor(max_duration_s * SAMPLE_RATE)
        pieces = _decode_stream(container, stream, max_samples, max_duration_s, split_channels)
    _check_sample_range(pieces)
    return pieces


def _check_sample_range(pieces: list[np.ndarray]) -> None:
    pieces = [piece for piece in pieces if piece.size]
    if not pieces:
        return
    # Through numpy's min and max, where a NaN propagates (Python's own would pass over it).
    low = float(np.min([piece.min() for piece in pieces]))
    high = float(np.max([piece.max() for piece in pieces]))
    if not (np.isfinite(low) and np.isfinite(high)):
        raise AudioDecodeError("the audio contains NaN or infinite samples")
    peak = max(-low, high)
    if peak > MAX_SAMPLE_MAGNITUDE:
        raise AudioDecodeError(
            f"the audio's samples reach {peak:.3g}, far outside full scale (-1 to 1); "
            f"this server takes at most {MAX_SAMPLE_MAGNITUDE:g}"
        )


def _decode_stream(
    container: av.container.InputContainer,
    stream: av.AudioStream,
    max_samples: int | None,
    max_duration_s: float | None,
    split_channels: bool,
) -> list[np.ndarray]:
    pieces: list[np.ndarray] = []
    total = 0
    resampler: av.AudioResampler | None = None
    frame_kind = None  # what the resampler was set up for: a frame's sample format, layout and rate
    bad_packets = 0
    last_error: av.FFmpegError | None = None
    try:
        for packet in container.demux(stream):
            try:
                frames = packet.decode()
            except av.FFmpegError as error:
                # A damaged packet in an otherwise good stream is skipped, as FFmpeg's own command
                # line does; a stream made of nothing else is refused below.
                bad_packets += 1
                last_error = error
                continue
            for frame in frames:
                kind = (frame.format.name, frame.layout.name, frame.layout.nb_channels, frame.sample_rate)
                if resampler is None or kind != frame_kind:
                    if resampler is not None:  # the format, layout or rate changed mid-stream
                        total += _append(pieces, resampler.resample(None), split_channels)
                        if split_channels and frame.layout.nb_channels != frame_kind[2]:
                            raise AudioDecodeError(
                                f"could not split the audio's channels: its stream changes from "
                                f"{frame_kind[2]} to {frame.layout.nb_channels} channels"
                            )
                    _check_channels(frame.layout.nb_channels)
                    frame_kind = kind
                    # The frame's own layout, kept: the channels are mixed in _append.
                    resampler = av.AudioResampler(format=_PACKED_FLOAT, rate=SAMPLE_RATE)
                frame.pts = None  # the resampler times its output itself; broken pts only upset it
                total += _append(pieces, resampler.resample(frame), split_channels)
                if max_samples is not None and total > max_samples:
                    raise AudioTooLongError(total / SAMPLE_RATE, max_duration_s, claimed=False)
        if resampler is not None:
            total += _append(pieces, resampler.resample(None), split_channels)
    except av.FFmpegError as error:  # the container itself broke off (truncated, corrupt index)
        if not pieces:
            raise AudioDecodeError(
                f"could not decode audio: the file is corrupt ({_reason(error)})"
            ) from None
    if not pieces and bad_packets:
        raise AudioDecodeError(
            f"could not decode audio: every one of its {bad_packets} audio packets is corrupt "
            f"({_reason(last_error)})"
        )
    if max_samples is not None and total > max_samples:
        raise AudioTooLongError(total / SAMPLE_RATE, max_duration_s, claimed=False)
    return pieces


def _check_channels(channels: int) -> None:
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioDecodeError(
            f"could not decode audio: its stream has {channels} channels; this server reads 1 to "
            f"{MAX_CHANNELS}"
        )


def _append(pieces: list[np.ndarray], frames: list[av.AudioFrame], split_channels: bool = False) -> int:
    """Mix each resampled frame (packed float) to mono, the mean of its channels, onto ``pieces``,
    or with ``split_channels`` keep it as [samples, channels]; returns the number of samples (per
    channel) added."""
    added = 0
    for frame in frames:
        if frame.format.is_planar:  # see _PACKED_FLOAT: never read a planar frame's planes
            raise AssertionError(f"the resampler gave a planar frame ({frame.format.name})")
        channels = frame.layout.nb_channels
        interleaved = frame.to_ndarray().reshape(-1, channels)  # [samples, channels], float32
        if split_channels:
            pieces.append(np.ascontiguousarray(interleaved))
            added += interleaved.shape[0]
            continue
        mono = interleaved[:, 0] if channels == 1 else interleaved.mean(axis=1, dtype=np.float32)
        pieces.append(np.ascontiguousarray(mono))
        added += mono.shape[0]
    return added


def _claimed_duration_s(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    """How long the file says its audio is, before decoding; None when it does not say."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _reason(error: av.FFmpegError | None) -> str:
    """FFmpeg's reason in words, without the file-name part PyAV adds (a Python object's repr)."""
    reason = getattr(error, "strerror", None) or "unknown error"
    return reason[0].lower() + reason[1:].rstrip(".")


def load_audio_file(path: str | os.PathLike, max_duration_s: float | None = None) -> np.ndarray:
    try:
        with open(path, "rb") as audio_file:
            data = audio_file.read()
    except OSError as error:
        raise AudioDecodeError(f"could not read {os.fspath(path)!r}: {error.strerror}") from None
    try:
        return decode_audio(data, max_duration_s)
    except AudioDecodeError as error:
        raise AudioDecodeError(f"{os.fspath(path)}: {error}") from None


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Mono float32 samples at ``orig_rate`` -> at ``new_rate``, with FFmpeg's resampler (swr: a
    band-limited windowed-sinc filter)."""
    if orig_rate == new_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    stream = StreamResampler(orig_rate, new_rate)
    return np.concatenate([stream.feed(samples), stream.flush()])


class StreamResampler:
    """One stream of mono float32 chunks (of any length, a live client's) -> at ``new_rate``, through
    one FFmpeg resampler that keeps its filter state across chunks: resampling each chunk on its own
    would put an edge at every chunk boundary, and swr gives nothing back for a chunk shorter than
    its filter until it is flushed."""

    def __init__(self, orig_rate: int, new_rate: int):
        self.orig_rate, self.new_rate = orig_rate, new_rate
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=new_rate)
        self._samples_in = 0  # the next chunk's first sample, as its frame's presentation time

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """The resampled samples ready after ``samples``; the filter holds back a few until later."""
        if self.orig_rate == self.new_rate:
            return samples.astype(np.float32, copy=False)
        if samples.size == 0:
            return np.zeros(0, np.float32)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, dtype=np.float32)[None], format="flt", layout="mono"
        )
        frame.sample_rate = self.orig_rate
        frame.pts = self._samples_in
        self._samples_in += samples.size
        return _joined(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """What the filter still holds, at the end of the stream."""
        if self.orig_rate == self.new_rate:
            return np.zeros(0, np.float32)
        return _joined(self._resampler.resample(None))


def _joined(frames: list[av.AudioFrame]) -> np.ndarray:
    if not frames:
        return np.zeros(0, np.float32)
    return np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])
