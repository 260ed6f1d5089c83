"""A channels=split request's channels through one model's window pipeline at once: each
channel's windows go to the same encoder and decoder deployments as every other request's, so
they share batches with everything else, and the request waits for the slowest channel."""

from __future__ import annotations

import asyncio

from deployments.http.audio_ingest import IngestedAudio
from deployments.orchestration.pipeline import WindowPipeline
from engine import LongFormMode, Transcription, long_form_cursor
from engine.types import DecodeOptions, Priority


async def transcribe_channels(
    pipeline: WindowPipeline,
    channels: list[IngestedAudio],
    options: DecodeOptions,
    long_form: LongFormMode,
    priority: Priority,
) -> list[Transcription]:
    """Each channel's transcript, in channel order."""
    transcribing = [
        asyncio.ensure_future(
            pipeline.transcribe(
                long_form_cursor(channel.samples, options, long_form, channel.windows), priority
            )
        )
        for channel in channels
    ]
    try:
        return list(await asyncio.gather(*transcribing))
    finally:
        for channel in transcribing:
            channel.cancel()  # done already, or another channel failed: its windows are not wanted
