"""What crosses the engine's boundary: how to decode a window, who waits for it, what comes back.

Deployments, the offline API and the HTTP layer speak only these; the decode loop's own request
state (engine/decode/request.py) never leaves the engine.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal


@dataclass(frozen=True)
class FallbackOptions:
    """openai-whisper's temperature fallback: a window whose output looks wrong is decoded again at
    the next temperature. Defaults are openai-whisper's; a threshold of None is not checked."""

    # Tried in order, from the first one above DecodeOptions.temperature.
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4  # above it the text repeats itself
    logprob_threshold: float | None = -1.0  # below it the model was unsure of its text
    # Above it, with the log-probability below its threshold, the window is silence: no retry, no text.
    no_speech_threshold: float | None = 0.6


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode one 30 s window; defaults follow openai-whisper's DecodingOptions (so no
    fallback: pass ``fallback=FallbackOptions()`` for transcribe()'s retries)."""

    language: str | None = None  # None: English for .en models, detected for multilingual ones
    # The languages the audio may be in (codes as ``language``): detection chooses only among
    # them, and one alone is decoded in as ``language`` is. With ``language`` too, that one must be
    # among them; it is decoded in, nothing is detected.
    languages: tuple[str, ...] | None = None
    # Terms the text should spell as given (names, products, jargon), put before the previous text
    # as faster-whisper puts its hotwords; they must fit the prompt's budget on their own.
    keywords: tuple[str, ...] | None = None
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False
    # Previous text, conditions the decoder (<|startofprev|> ...): words, or token ids as decoded
    # (sequential long-form passes the previous window's tokens, timestamps included).
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None  # new tokens; None: half the text context (224), as openai-whisper
    temperature: float = 0.0
    seed: int | None = None  # for temperature > 0; None: torch's default generator (fallback: a fixed seed)
    ignore_eot: bool = False  # benchmarks only: decode exactly max_tokens, end of text or not
    fallback: FallbackOptions | None = None
    word_timestamps: bool = False  # needs timestamps; aligns words with the cross-attention heads
    token_logprobs: bool = False  # return each text token's log-probability (OpenAI's include[]=logprobs)
    # Beam search at temperature 0 (openai-whisper's beam_size, patience, length_penalty): 1 is
    # greedy. patience: finish once beam_size * patience hypotheses have ended (None: 1.0);
    # length_penalty: None ranks by log-probability per token, alpha in [0, 1] by Google NMT's penalty.
    beam_size: int = 1
    patience: float | None = None
    length_penalty: float | None = None
    best_of: int = (
        1  # above temperature 0: decode this many samples and keep the best (openai-whisper's best_of)
    )

    def hypotheses_at(self, temperature: float) -> int:
        """Sequences an attempt at ``temperature`` decodes at once: beams at 0, best-of samples above."""
        return self.beam_size if temperature == 0 else self.best_of

    @cached_property
    def max_hypotheses(self) -> int:
        """The most sequences any of its attempts decodes at once (what admission reserves); kept,
        since the decode loop asks for every running window at every step."""
        return max(self.hypotheses_at(temperature) for temperature in self.temperatures())

    def temperatures(self) -> tuple[float, ...]:
        """The temperatures a window may be decoded at, in the order they are tried."""
        if self.fallback is None:
            return (self.temperature,)
        return (self.temperature, *(t for t in self.fallback.temperatures if t > self.temperature))


class Priority(str, enum.Enum):
    """Who waits for a request: a person (interactive) or a job (batch). Interactive work is
    admitted first; batch work fills the capacity it leaves, and is owed ``batch_share`` of it
    while both wait (``batch_places``), so a long file progresses under any interactive load;
    batch work that has waited ``batch_aging_s`` to be admitted ranks as interactive."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


def is_promoted(priority: Priority, waited_s: float, batch_aging_s: float) -> bool:
    """Whether a piece of work ranks as interactive now: it is, or it is batch work that has aged.
    One rule for the encoder's batches and the decoder's admissions."""
    return priority == Priority.INTERACTIVE or waited_s >= batch_aging_s


def batch_places(capacity: int, batch_share: float) -> int:
    """How many of ``capacity`` places (a decoder's sequence slots, an encoder forward's windows) the
    oldest batch work is owed while interactive work waits too: ``batch_share`` of them rounded up,
    so at least one when the share is above 0, but never all of them, so interactive work keeps a
    place and its priority still means something. With one place there is nothing to share: batch
    work then relies on ``batch_aging_s``. One rule for the encoder's batches and the decoder's
    admissions."""
    if batch_share <= 0 or capacity <= 1:
        return 0
    # Rounded first: a share times a capacity lands a hair above a whole number (0.1 * 70).
    return min(capacity - 1, math.ceil(round(batch_share * capacity, 9)))


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end of text sampled
    LENGTH = "length"  # max_tokens or the text context reached
    ABORTED = "aborted"
    ERROR = "error"


@dataclass(frozen=True)
class TimedWord:
    """A word (with its leading space and any punctuation) and when it is spoken, in seconds from
    the window's start."""

    word: str
    start_s: float
    end_s: float
    tokens: list[int]


@dataclass(frozen=True)
class TimedText:
    """A stretch of a window's text between two of Whisper's timestamp tokens; times in seconds
    from the window's start."""

    start_s: float
    end_s: float
    text: str
    tokens: list[int]
    closed: bool = True  # False for text after the last timestamp: it may go on past the window
    words: list[TimedWord] | None = None  # with word timestamps on; their text joins to ``text``


@dataclass(frozen=True)
class TokenLogprob:
    """A text token as OpenAI's ``logprobs`` lists it: its text and its log-probability when sampled."""

    token: str
    logprob: float


@dataclass(frozen=True)
class DecodeResult:
    request_id: str
    tokens: list[int]  # sampled tokens, timestamps included, end of text excluded
    text: str
    avg_logprob: float
    no_speech_prob: float
    language: str | None
    temperature: float
    finish_reason: FinishReason
    error: str | None = None  # why, when finish_reason is ERROR
    retriable: bool = False  # an ERROR that trying again may cure (e.g. a failed K/V transfer)
    segments: list[TimedText] | None = None  # with timestamps on: the text cut at timestamp tokens
    compression_ratio: float = 0.0  # of the text: openai-whisper's repetition signal
    no_speech: bool = False  # judged silence by the fallback thresholds: no text is returned
    token_logprobs: list[TokenLogprob] | None = None  # with options.token_logprobs: its text tokens'
