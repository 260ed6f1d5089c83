"""One live turn of a realtime session: its audio as it arrives, the partial passes that turn the
audio so far into stable text, and the final pass. Every pass is one window through the same
``WindowPipeline`` as file requests (deployments/orchestration/pipeline.py), so it shares encoder
batches and decoder steps with every other stream and file.

A turn longer than one 30 s window is cut at a quiet point (``split_windows``): the first window
gets its final pass, its text is committed, and the turn carries on in a new window prompted with
the text committed so far.

Final passes (and carry-overs) rank as interactive work; partial passes as batch work, so that on
a busy encoder a turn's final pass overtakes the partial passes of every stream (with every pass
interactive, a final pass queues behind the partial passes of all the other streams). A partial
pass also waits for one of the replica's partial slots (deployments/orchestration/partial_schedule.py),
which streams take in turn; final passes and carry-overs take none.

The turn knows no protocol: each new piece of stable text goes to ``on_delta``, which the realtime
session (deployments/http/realtime.py) turns into its events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from deployments.config import RealtimeOptions
from deployments.metrics import ServingMetrics
from deployments.orchestration.partial_schedule import PartialSchedule, PassRequest
from deployments.orchestration.pipeline import WindowPipeline
from engine import (
    N_SAMPLES,
    SAMPLE_RATE,
    LocalAgreement,
    SpeechOptions,
    context_frames,
    detect_speech,
    resample,
    split_windows,
)
from engine.types import DecodeOptions, FallbackOptions, Priority, TokenLogprob

logger = logging.getLogger("ray.serve")

OnDelta = Callable[[str], Awaitable[None]]  # the turn's next piece of stable text
_PASSES: set[asyncio.Task] = set()
# No partial pass before a turn holds this much audio: on a second of speech tiny.en hears words
# that are not there, often enough for three passes to agree on them ("They don't" for "The old").
PARTIAL_MIN_AUDIO_S = 1.5
# Fast speech is ~4 tokens a second; a partial pass may decode this many for its audio.
PARTIAL_TOKENS_BASE = 10
PARTIAL_TOKENS_PER_S = 6


@dataclass(frozen=True)
class TurnSettings:
    """What a turn's passes need of its session's settings."""

    sample_rate_hz: int  # the client's audio rate; each pass resamples to 16 kHz
    language: str | None = None  # every pass's, partial and final
    prompt: str | None = None  # the first window's prompt; later windows are prompted with the text before
    token_logprobs: bool = False  # final passes return each text token's log-probability


@dataclass(frozen=True)
class TurnTranscript:
    """A finished turn: its whole text (the deltas joined) and, when the settings asked for them,
    the text tokens of its final passes (each window's, in order) with their log-probabilities."""

    text: str
    token_logprobs: list[TokenLogprob] | None = None


class LiveTurn:
    def __init__(
        self,
        item_id: str,
        model_name: str,
        settings: TurnSettings,
        pipeline: WindowPipeline,
        on_delta: OnDelta,
        metrics: ServingMetrics,
        schedule: PartialSchedule,
        options: RealtimeOptions,
    ):
        self.item_id = item_id
        self.model_name = model_name  # the served model whose pipeline runs the passes (and bills them)
        self.options = options
        self.schedule = schedule
        self.settings = settings
        self.sample_rate_hz = settings.sample_rate_hz  # the client's rate; resampled per pass
        self.pipeline = pipeline
        self.on_delta = on_delta
        self.metrics = metrics
        self.agreement = LocalAgreement(span_s=options.partial_agreement_s)
        self._chunks: list[np.ndarray] = []
        self.num_samples = 0  # at the client's rate
        self._window_start = 0  # the open window's first sample, at the client's rate
        self._window_prompt = settings.prompt  # the session's prompt; then the text committed before
        self._pass: asyncio.Task | None = None  # the partial pass (or window carry-over) in flight
        self._passed_samples = 0  # num_samples when the last pass started
        self._last_pass_s = time.monotonic()  # when the last partial pass started (or the turn opened)
        self._request: PassRequest | None = None  # waiting for one of the replica's partial slots
        self._speech_end = 0  # num_samples after the latest audio that held speech (see append)
        self._passes = 0
        self._carry_in_flight = False  # a carry-over's text is part of the turn's: finish() awaits it
        self._closed = False  # finished or cancelled: partial passes still out are ignored
        self._final_logprobs: list[TokenLogprob] = []  # the final passes' so far, window by window

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate_hz

    @property
    def pass_in_flight(self) -> bool:
        return self._pass is not None and not self._pass.done()

    def append(self, samples: np.ndarray, speech: bool = True) -> None:
        """``speech``: whether the session's VAD heard speech in ``samples`` (without a VAD, any
        audio may hold some)."""
        self._chunks.append(samples)
        self.num_samples += len(samples)
        if speech:
            self._speech_end = self.num_samples

    def new_audio_s(self) -> float:
        """Audio that arrived since the last pass started (none before the turn is long enough
        for a partial pass to be worth its cost)."""
        if self.duration_s < PARTIAL_MIN_AUDIO_S:
            return 0.0
        return (self.num_samples - self._passed_samples) / self.sample_rate_hz

    def offer_partial_pass(self) -> None:
        """The session's partial cadence came round: ask for a pass over the audio so far if half
        an interval of it is new and any of that is speech. A turn whose previous pass is still
        out, or still waits for a slot, is behind and asks nothing more."""
        if self._closed or self.new_audio_s() < self.options.partial_interval_ms / 2000:
            return
        if self.pass_in_flight or self._request is not None:
            self.metrics.skipped_partials.inc()
            return
        if self._window_samples_16k_count() > N_SAMPLES:
            # A final pass of the window's first 30 s: text the turn needs, not a preview, so it
            # takes no partial slot (as the turn's final pass takes none).
            self._passed_samples = self.num_samples
            self._track(asyncio.create_task(self._carry_over()))
            return
        if self._speech_end <= self._passed_samples:
            # Only silence since the last pass (a pause inside the turn): its text cannot change.
            self.metrics.unchanged_partials.inc()
            return
        self._request = PassRequest(self._last_pass_s, self._start_partial_pass)
        self.schedule.request(self._request)

    def _start_partial_pass(self) -> asyncio.Task | None:
        """A slot came free for this turn: transcribe the open window's audio so far, as it is now."""
        self._request = None
        if self._closed or self._window_samples_16k_count() > N_SAMPLES:
            return None  # closed meanwhile, or grown past the window: the next offer carries it over
        self._passed_samples = self.num_samples
        self._last_pass_s = time.monotonic()
        return self._track(asyncio.create_task(self._partial_pass()))

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self._pass = task
        # The event loop keeps only weak references to tasks: hold each until it is done, however
        # early the session lets go of this turn.
        _PASSES.add(task)
        task.add_done_callback(_PASSES.discard)
        return task

    async def finish(self, speech_only: bool = False) -> TurnTranscript:
        """The final pass: every delta not sent yet, then the turn's whole text (the deltas joined).
        A partial pass in flight is dropped (its text ignored), so it never delays the final one; a
        carry-over in flight is part of the text and is awaited.

        ``speech_only``: audio the session's VAD heard no speech in (an idle timeout's quiet
        stretch). It is decoded only if the file endpoint's speech detection, more sensitive,
        finds speech in it; else its text is empty, as a file's silence is, and nothing is decoded
        (Whisper writes words such as "you" into silence)."""
        self._close()
        if speech_only and not await asyncio.to_thread(self._has_speech):
            return TurnTranscript("", [] if self.settings.token_logprobs else None)
        if self._carry_in_flight:
            await asyncio.wait([self._pass])
        while self._window_samples_16k_count() > N_SAMPLES:
            await self._carry_over()
        samples = self._window_samples_16k()
        if len(samples):
            result = await self._decode("f", samples, final=True)
            await self._send_delta(self.agreement.finish_window(result.text))
        logprobs = self._final_logprobs if self.settings.token_logprobs else None
        return TurnTranscript(self.agreement.text, logprobs)

    def _has_speech(self) -> bool:
        return bool(detect_speech(self._window_samples_16k(), SpeechOptions()))

    def cancel(self) -> None:
        """The client cleared the buffer or went away: a pass in flight runs out (cancelling a
        Serve call between encoder and decoder would strand its staged K/V until the staging's
        unclaimed timeout) and its text is ignored."""
        self._close()

    def _close(self) -> None:
        self._closed = True
        self.schedule.withdraw(self._request)
        self._request = None

    # ---- passes -------------------------------------------------------------------------------

    async def _partial_pass(self) -> None:
        started = time.perf_counter()
        heard_s = self.duration_s
        try:
            result = await self._decode("p", self._window_samples_16k(), final=False)
        except Exception:  # a partial pass is an extra: the final pass reports failures
            logger.warning("realtime %s: a partial pass failed", self.item_id, exc_info=True)
            return
        self.metrics.observe_partial_pass(time.perf_counter() - started)
        if not self._closed:
            await self._send_delta(self.agreement.update(result.text, heard_s))

    async def _carry_over(self) -> None:
        """Close the open window's first 30 s (cut at a quiet point) with a final pass."""
        self._carry_in_flight = True
        try:
            first = split_windows(self._window_samples_16k())[0]
            result = await self._decode("c", first.samples, final=True)
            await self._send_delta(self.agreement.finish_window(result.text))
            self._window_start += round(len(first.samples) * self.sample_rate_hz / SAMPLE_RATE)
            self._window_prompt = self.agreement.text or self.settings.prompt
        finally:
            self._carry_in_flight = False

    async def _decode(self, kind: str, samples: np.ndarray, final: bool):
        self._passes += 1
        duration_s = len(samples) / SAMPLE_RATE
        fixed = self.options.fixed_output_tokens  # benchmarks only
        options = DecodeOptions(
            language=self.settings.language,
            prompt=self._window_prompt or None,
            # The final pass decodes as the file endpoint does (openai-whisper's fallback), so a
            # turn's text is the file's text; partial passes are one greedy decode each, capped
            # near the most words the audio can hold: on a second of audio tiny.en can fall into a
            # repetition loop that would run to the token limit for text no one keeps.
            fallback=FallbackOptions() if final and fixed is None else None,
            max_tokens=fixed
            or (None if final else min(224, int(PARTIAL_TOKENS_BASE + PARTIAL_TOKENS_PER_S * duration_s))),
            ignore_eot=fixed is not None,
            beam_size=self.options.final_beam_size if final else 1,
            token_logprobs=final and self.settings.token_logprobs,
        )
        window_id = f"{self.item_id}-{kind}{self._passes}"
        # A final pass is what the speaker waits for: interactive, ahead of every partial pass
        # queued in the encoders and decoders (they rank as batch work and age as it does).
        priority = Priority.INTERACTIVE if final else Priority.BATCH
        result = await self.pipeline.decode_window(
            window_id,
            samples,
            options,
            priority,
            encoder_frames=None if final else self._partial_frames(samples),
        )
        if final:
            self._final_logprobs += result.token_logprobs or []
        return result

    def _partial_frames(self, samples: np.ndarray) -> int | None:
        """The encoder frames a partial pass over ``samples`` is encoded over (None: the full
        window). Final passes keep the full window: the turn's text is the file endpoint's."""
        options = self.options
        if not options.partial_passes_on_audio:
            return None
        return context_frames(
            len(samples),
            options.partial_context_min_s,
            options.partial_context_pad_s,
            options.partial_context_step_s,
        )

    async def _send_delta(self, delta: str) -> None:
        if delta:
            await self.on_delta(delta)

    # ---- audio --------------------------------------------------------------------------------

    def samples_16k(self) -> np.ndarray:
        """The whole turn's audio so far, every window of it, at 16 kHz."""
        self._join_chunks()
        if not self._chunks:
            return np.zeros(0, dtype=np.float32)
        return resample(self._chunks[0], self.sample_rate_hz, SAMPLE_RATE)

    def _join_chunks(self) -> None:
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]

    def _window_samples_16k(self) -> np.ndarray:
        self._join_chunks()
        if not self._chunks:
            return np.zeros(0, dtype=np.float32)
        return resample(self._chunks[0][self._window_start :], self.sample_rate_hz, SAMPLE_RATE)

    def _window_samples_16k_count(self) -> int:
        return (self.num_samples - self._window_start) * SAMPLE_RATE // self.sample_rate_hz
