"""Turns in a live stream, as OpenAI's `server_vad` finds them: speech starts when Silero VAD's
probability reaches the threshold (the turn's audio begins ``prefix_padding_ms`` earlier), and
stops after ``silence_duration_ms`` below it. With ``idle_timeout_ms``, a stretch that long
without speech (since the stream began, the last turn ended or the last timeout) times out.

Fed chunks of any length at 16 kHz; events carry times on the stream's own clock (seconds of audio
fed), never the wall clock, so a stream that arrives in bursts finds the same turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model.vad import FRAME_S, SileroVAD

# Silero's own recipe (its get_speech_timestamps): once in speech, a frame counts as silence only
# below threshold - 0.15, so a word's quiet consonants do not end a turn.
SILENCE_HYSTERESIS = 0.15


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_s: float  # where the turn's audio begins: detected start minus the prefix padding


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_s: float  # where the speech ended: the start of the silence that ended the turn
    detected_s: float  # when the silence had lasted long enough (stream time)


@dataclass(frozen=True)
class IdleTimedOut:
    """No speech for ``idle_timeout_ms``: the quiet stretch from ``audio_start_s`` to ``audio_end_s``.
    The next stretch (and the next turn's audio) begins where this one ends.

    Counted in audio time, like every event here, not on the wall clock: OpenAI's
    `timeout_triggered` gives the stretch as offsets in the audio appended, about the timeout
    apart, and a stream that arrives in bursts times out where a steady one does. A client that
    sends no audio at all has none to time out (a session's own idle limit covers it)."""

    audio_start_s: float  # where the quiet began: the stream's start, a turn's end or the last timeout
    audio_end_s: float  # where it had lasted idle_timeout_ms (to the next 32 ms frame)


TurnEvent = SpeechStarted | SpeechStopped | IdleTimedOut


class TurnDetector:
    def __init__(
        self,
        vad: SileroVAD,
        threshold: float,
        prefix_padding_ms: float,
        silence_duration_ms: float,
        idle_timeout_ms: float | None = None,
    ):
        self.vad = vad
        self.stream = vad.stream()
        self.threshold = threshold
        self.prefix_padding_s = prefix_padding_ms / 1000
        self.silence_duration_s = silence_duration_ms / 1000
        self.idle_timeout_s = idle_timeout_ms / 1000 if idle_timeout_ms is not None else None
        self.in_speech = False
        self.speech_heard_s = 0.0  # the end of the latest frame that started or kept up speech
        self._silence_start_s: float | None = None  # in speech: where the current run of silence began
        # Where the last turn (or quiet stretch) ended: a new turn's audio never reaches back before
        # it, and out of speech the quiet has lasted since then.
        self._turn_start_s = 0.0

    def feed(self, samples: np.ndarray) -> list[TurnEvent]:
        """The next samples of the stream (16 kHz float32) -> the turn events they complete, in order."""
        first_frame = self.stream.frames_done
        events: list[TurnEvent] = []
        for offset, probability in enumerate(self.vad.feed(self.stream, samples)):
            start_s = (first_frame + offset) * FRAME_S
            if not self.in_speech:
                if probability >= self.threshold:
                    self.in_speech = True
                    self.speech_heard_s = start_s + FRAME_S
                    self._silence_start_s = None
                    events.append(SpeechStarted(max(self._turn_start_s, start_s - self.prefix_padding_s)))
                elif self.idle_timeout_s is not None:
                    end_s = start_s + FRAME_S
                    if end_s - self._turn_start_s >= self.idle_timeout_s:
                        events.append(IdleTimedOut(self._turn_start_s, end_s))
                        self.end_turn(end_s)
                continue
            if probability >= self.threshold - SILENCE_HYSTERESIS:
                self.speech_heard_s = start_s + FRAME_S
                self._silence_start_s = None
                continue
            if self._silence_start_s is None:
                self._silence_start_s = start_s
            end_s = start_s + FRAME_S
            if end_s - self._silence_start_s >= self.silence_duration_s:
                events.append(SpeechStopped(self._silence_start_s, end_s))
                self.end_turn(end_s)
        return events

    def end_turn(self, stream_s: float) -> None:
        """The turn ended here (speech stopped, the quiet timed out, or the client committed or
        cleared the buffer): listen for the next one, whose audio starts no earlier; the quiet
        counts from here."""
        self.in_speech = False
        self._silence_start_s = None
        self._turn_start_s = stream_s
