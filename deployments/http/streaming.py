"""OpenAI's transcription stream as server-sent events: a ``transcript.text.delta`` as each
window's text is ready, in order, then ``transcript.text.done`` with the usage in seconds of
audio; the deltas join to the final text. The status line has gone out before the first window is
decoded, so a failure travels as an ``error`` event carrying OpenAI's error object.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from deployments.http.errors import api_error_of
from deployments.http.formats import duration_usage, languages_of
from engine import LongFormCursor
from engine.types import DecodeResult


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


async def transcription_events(
    results: AsyncIterator[DecodeResult], cursor: LongFormCursor, finished: Callable[[int, float], None]
) -> AsyncIterator[str]:
    """The events of ``results``, the windows of ``cursor`` as they are decoded. ``finished`` is
    told, once, the status the stream ended with and the seconds of audio it transcribed."""
    texts: list[str] = []
    streamed = ""
    try:
        async for result in results:
            texts.append(result.text)
            # The final text is the windows' text stripped at both ends; holding back trailing
            # spaces keeps every delta a piece of it.
            shown = "".join(texts).strip()
            if len(shown) > len(streamed):
                yield sse({"type": "transcript.text.delta", "delta": shown[len(streamed) :]})
                streamed = shown
        transcription = cursor.transcription()
        yield sse(
            {
                "type": "transcript.text.done",
                "text": transcription.text,
                "languages": languages_of(transcription),
                "usage": duration_usage(transcription.duration_s),
            }
        )
    except Exception as error:
        api_error = api_error_of(error)
        finished(api_error.status, 0.0)
        yield sse({"type": "error", "error": api_error.body()})
        return
    finished(200, transcription.duration_s)
