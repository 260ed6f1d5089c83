"""Speakers in a realtime session (`transcription.diarize`, a vendor field): each completed turn's
voice, embedded by the diarizer deployment while the turn's final pass runs, labelled with the
session's speaker it matches (deployments/orchestration/session_speakers.py), lettered A, B, ... in
order of appearance as a file's diarized_json letters them.

A turn is one speaker's: a turn with two voices takes the label of the one heard most in it. A turn
whose voice cannot be had (no speech in it, or the diarizer failed) gets no speaker, not an error:
its transcript is what the client waits for.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from deployments.http.realtime_events import RealtimeEventError, SessionSettings, transcription_param
from deployments.http.speakers import letter_label
from deployments.orchestration.diarization import DiarizationClient
from deployments.orchestration.session_speakers import SessionSpeakers

logger = logging.getLogger("ray.serve")


class LiveSpeakers:
    def __init__(self, diarization: DiarizationClient | None):
        """``diarization``: the app's diarizer (config `diarizer`), or None where it has none."""
        self.diarization = diarization
        self.speakers = SessionSpeakers()
        self._voices: dict[str, asyncio.Task] = {}  # by turn item id: voices being embedded

    def check(self, settings: SessionSettings, event_type: str) -> None:
        """Refuse settings that ask for speakers of an app without a diarizer."""
        if settings.diarize and self.diarization is None:
            raise RealtimeEventError(
                "diarization_unavailable",
                "This server has no diarizer (config `diarizer`); `diarize` cannot be on.",
                transcription_param(event_type, "diarize"),
            )

    def embed(self, item_id: str, samples_16k: np.ndarray) -> None:
        """Start embedding a committed turn's voice, beside its final pass rather than after it."""
        self._voices[item_id] = asyncio.create_task(self._voice(samples_16k))

    def take(self, item_id: str) -> asyncio.Task | None:
        """The turn's voice under way (its ``label`` to come), or None where the turn is not diarized."""
        return self._voices.pop(item_id, None)

    async def _voice(self, samples_16k: np.ndarray) -> np.ndarray | None:
        try:
            return await self.diarization.voice_embedding(samples_16k)
        except Exception:
            logger.warning("realtime: a turn's voice could not be embedded", exc_info=True)
            return None

    def label(self, voice: np.ndarray | None) -> str | None:
        """The turn's speaker label; call once per turn, in the order the turns were spoken."""
        speaker = self.speakers.speaker_of(voice)
        return letter_label(speaker) if speaker is not None else None
