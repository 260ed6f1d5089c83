"""A realtime session's server VAD: OpenAI's `server_vad` (engine/transcribe/turn_detection.py) on
the session's audio, resampled to 16 kHz, with the detector's times turned into positions on the
session's clock (samples appended since the session opened, at the client's rate); and the audio
kept between turns, which a new turn's prefix padding or an idle timeout's quiet stretch reaches
back to.
"""

from __future__ import annotations

import numpy as np

from deployments.http.realtime_events import ServerVAD
from engine import SAMPLE_RATE, StreamResampler, TurnDetector, TurnEvent, load_silero_vad


class ServerVadTurns:
    def __init__(self, settings: ServerVAD, rate_hz: int, origin: int):
        """``origin``: the session's sample where detection starts (the detector's clock starts there)."""
        self.settings = settings
        self.rate_hz = rate_hz
        self.detector = TurnDetector(
            load_silero_vad(),
            settings.threshold,
            settings.prefix_padding_ms,
            settings.silence_duration_ms,
            settings.idle_timeout_ms,
        )
        self._to_16k = StreamResampler(rate_hz, SAMPLE_RATE)
        self._origin = origin
        self._received = origin  # the session's samples so far
        self._kept: list[np.ndarray] = []  # between turns: the latest audio
        self._kept_start = origin  # the session's sample where _kept begins
        # Whether the last samples fed held speech (a frame they completed started or kept it up):
        # an open turn whose new audio held none has nothing new for a partial pass to hear.
        self.heard_speech = False

    def feed(self, samples: np.ndarray, between_turns: bool) -> list[TurnEvent]:
        """The session's next samples (kept only between turns: an open turn holds its own) -> the
        turn events they complete, in order."""
        if between_turns:
            self._kept.append(samples)
        self._received += len(samples)
        heard_s = self.detector.speech_heard_s
        events = self.detector.feed(self._to_16k.feed(samples))
        self.heard_speech = self.detector.speech_heard_s > heard_s
        return events

    def sample_of(self, stream_s: float) -> int:
        """A detector time as the session's sample."""
        return self._origin + round(stream_s * self.rate_hz)

    def ms_of(self, stream_s: float) -> int:
        """A detector time as milliseconds of the session's audio, as OpenAI's events give them."""
        return round(self.sample_of(stream_s) / self.rate_hz * 1000)

    def take(self, start: int, end: int | None = None) -> tuple[int, np.ndarray]:
        """The kept audio from sample ``start`` to ``end`` (the newest sample without one), clamped
        to what is kept, with the sample it starts at. It and all before it are dropped; what
        follows ``end`` stays kept."""
        kept = np.concatenate(self._kept) if self._kept else np.zeros(0, dtype=np.float32)
        first = min(max(start - self._kept_start, 0), len(kept))
        last = len(kept) if end is None else min(max(end - self._kept_start, first), len(kept))
        taken_start = self._kept_start + first
        self._kept, self._kept_start = [kept[last:]], self._kept_start + last
        return taken_start, kept[first:last]

    def end_turn(self) -> None:
        """A turn ended at the newest sample (speech stopped, a commit, a clear): the next turn's
        audio, and the quiet an idle timeout counts, start after it."""
        self._kept, self._kept_start = [], self._received
        self.detector.end_turn((self._received - self._origin) / self.rate_hz)

    def trim(self) -> None:
        """Keep only what a turn's prefix padding could reach back to, and with an idle timeout the
        quiet stretch it may commit (never longer than the timeout)."""
        keep_s = (self.settings.prefix_padding_ms + (self.settings.idle_timeout_ms or 0)) / 1000 + 1
        keep = int(self.rate_hz * keep_s)
        kept = np.concatenate(self._kept) if self._kept else np.zeros(0, dtype=np.float32)
        if len(kept) > keep:
            self._kept_start += len(kept) - keep
            kept = kept[-keep:]
        self._kept = [kept]
