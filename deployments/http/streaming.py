"""OpenAI's transcription stream as server-sent events: a ``transcript.text.delta`` as each
window's text is ready, in order, then ``transcript.text.done`` with its languages and the usage
in seconds of audio; the deltas join to the final text. A stream asked for with segments
(verbose_json) also gets a ``transcript.text.segment`` for each of a window's segments once the
window is decoded; one asked for with include[]=logprobs gets each delta's token log-probabilities
on the delta and all of them on done. A diarized stream (diarized_json, or verbose_json with
diarize=true) sends its segments cut where the speaker changes, each with its ``speaker``, as soon
as both the segment's window and the recording's diarization are done (the diarizer works on the
whole recording beside the windows). The status line has gone out before the first window is
decoded, so a failure travels as an ``error`` event carrying OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from deployments.http.errors import api_error_of
from deployments.http.formats import diarized_segment, duration_usage, languages_of, logprobs_of_windows
from deployments.http.segments import Segment, window_segments
from deployments.http.speakers import Speakers
from engine import LongFormCursor, WindowTimeline
from engine.types import DecodeResult


@dataclass(frozen=True)
class StreamContents:
    """What a stream carries beyond the text: from the request's format and include[]."""

    segments: bool = False  # a transcript.text.segment event per segment (verbose_json)
    words: bool = False  # the segment events carry their words (timestamp_granularities[]=word)
    logprobs: bool = False  # include[]=logprobs


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def segment_event(segment: Segment, with_words: bool) -> dict:
    """OpenAI's ``transcript.text.segment``: the segment's id, times on the file's timeline and
    text (a speaker only where the audio was diarized), and with word timestamps its words."""
    event = {
        "type": "transcript.text.segment",
        "id": f"seg_{segment.id}",
        "start": segment.start_s,
        "end": segment.end_s,
        "text": segment.text,
    }
    if with_words:
        event["words"] = [
            {"word": word.word.strip(), "start": word.start_s, "end": word.end_s}
            for word in segment.words or []
        ]
    return event


async def transcription_events(
    results: AsyncIterator[DecodeResult],
    cursor: LongFormCursor,
    finished: Callable[[int, float], None],
    contents: StreamContents = StreamContents(),
    speakers: asyncio.Future[Speakers] | None = None,
) -> AsyncIterator[str]:
    """The events of ``results``, the windows of ``cursor`` as they are decoded. ``finished`` is
    told, once, the status the stream ended with and the seconds of audio it transcribed.
    ``speakers``: the recording's diarization under way; its segment events wait for it."""
    streamed_any = False  # a delta has gone out: leading spaces of the text are behind us
    held_back = ""  # trailing spaces not sent yet: the final text is stripped at both ends
    unsent_logprobs: list[dict] = []  # of windows whose text added nothing to show yet
    # Decoded windows whose segments are not sent yet, each with where its audio lies in the file:
    # each window's segments are made once, so a long file's stream costs what its windows cost.
    unsent_windows: list[tuple[DecodeResult, WindowTimeline]] = []
    windows_decoded = 0
    segments_sent = 0  # transcript segments sent (diarized: cut into this many or more events)
    events_sent = 0

    def segment_events() -> list[str]:
        nonlocal segments_sent, events_sent
        segments: list[Segment] = []
        for window, timeline in unsent_windows:
            segments.extend(window_segments(window, timeline, first_id=segments_sent + len(segments)))
        unsent_windows.clear()
        segments_sent += len(segments)
        if speakers is None:
            return [sse(segment_event(segment, contents.words)) for segment in segments]
        spoken = speakers.result().spoken_segments(segments, first_id=events_sent)
        events_sent += len(spoken)
        return [sse(diarized_segment(segment)) for segment in spoken]

    try:
        async for result in results:
            unsent_windows.append((result, cursor.window_timeline(windows_decoded)))
            windows_decoded += 1
            if contents.logprobs:
                unsent_logprobs.extend(logprobs_of_windows([result]))
            # The final text is the windows' text stripped at both ends; holding back leading and
            # trailing spaces keeps every delta a piece of it.
            held_back += result.text if streamed_any else result.text.lstrip()
            new_text = held_back.rstrip()
            if new_text:
                delta = {"type": "transcript.text.delta", "delta": new_text}
                if contents.logprobs:
                    delta["logprobs"], unsent_logprobs = unsent_logprobs, []
                yield sse(delta)
                streamed_any, held_back = True, held_back[len(new_text) :]
            if contents.segments and (speakers is None or speakers.done()):
                for event in segment_events():
                    yield event
        if speakers is not None:
            await speakers
            for event in segment_events():
                yield event
        transcription = cursor.transcription()
        done = {
            "type": "transcript.text.done",
            "text": transcription.text,
            "languages": languages_of(transcription),
        }
        if contents.logprobs:
            done["logprobs"] = logprobs_of_windows(transcription.windows)
        done["usage"] = duration_usage(transcription.duration_s)
        yield sse(done)
    except Exception as error:
        api_error = api_error_of(error)
        finished(api_error.status, 0.0)
        yield sse({"type": "error", "error": api_error.body()})
        return
    finally:
        if speakers is not None:
            speakers.cancel()  # a client gone or a window failed: the diarizer's answer is not wanted
    finished(200, transcription.duration_s)
