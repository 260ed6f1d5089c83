"""A channels=split request's channels through one model's window pipeline at once: each
channel's windows go to the same encoder and decoder deployments as every other request's, so
they share batches with everything else, and the request waits for the slowest channel."""

from __future__ import annotations

import asyncio

from deployments.orchestration.pipeline import WindowPipeline
from engine import LongFormCursor, Transcription
from engine.types import Priority


async def transcribe_channels(
    pipeline: WindowPipeline, channels: list[LongFormCursor], priority: Priority
) -> list[Transcription]:
    """Each channel's transcript, in channel order. A channel comes as its long-form cursor, built
    by the caller from however it took the audio in, so that orchestration knows windows only."""
    transcribing = [asyncio.ensure_future(pipeline.transcribe(channel, priority)) for channel in channels]
    try:
        return list(await asyncio.gather(*transcribing))
    finally:
        for channel in transcribing:
            channel.cancel()  # done already, or another channel failed: its windows are not wanted
