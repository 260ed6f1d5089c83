"""What crosses the engine's boundaries: decoding options, a request in flight, its result."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from engine.kv.block_pool import RequestBlocks

if TYPE_CHECKING:
    from engine.decode.runner import ModelRunner


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

    def temperatures(self) -> tuple[float, ...]:
        """The temperatures a window may be decoded at, in the order they are tried."""
        if self.fallback is None:
            return (self.temperature,)
        return (self.temperature, *(t for t in self.fallback.temperatures if t > self.temperature))


class Priority(str, enum.Enum):
    """Who waits for a request: a person (interactive) or a job (batch). Interactive work is
    scheduled first; batch work that has waited ``batch_aging_s`` (to be admitted, or to run a
    step) is scheduled as interactive, so a steady interactive stream cannot starve it."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


def is_promoted(priority: Priority, waited_s: float, batch_aging_s: float) -> bool:
    """Whether a piece of work ranks as interactive now: it is, or it is batch work that has aged.
    One rule for the encoder's batches and the decoder's admissions."""
    return priority == Priority.INTERACTIVE or waited_s >= batch_aging_s


# A pending token the host does not know yet: the device reads it from the last launched step.
FROM_LAST_STEP = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end of text sampled
    LENGTH = "length"  # max_tokens or the text context reached
    ABORTED = "aborted"
    ERROR = "error"


class CrossKVSource(Protocol):
    """Where a request's cross-attention K/V comes from; loaded into its blocks at admission."""

    def load_into(self, runner: "ModelRunner", block_ids: list[int]) -> None: ...

    def discard(self) -> None:
        """Give the K/V up unloaded (the request ended before admission); never raises."""


@dataclass
class CrossKVTensor:
    """Cross-attention K/V already computed in this process: [layers, 2, frames, H, D]."""

    cross_kv: torch.Tensor

    def load_into(self, runner: "ModelRunner", block_ids: list[int]) -> None:
        runner.storage.write_sequence(block_ids, self.cross_kv)

    def discard(self) -> None:
        pass  # an in-process tensor: freed with the request


@dataclass
class EncoderStates:
    """Encoder output [frames, d_model]; the decoder side projects it to cross K/V itself."""

    states: torch.Tensor

    def load_into(self, runner: "ModelRunner", block_ids: list[int]) -> None:
        runner.write_cross_kv_from_states(block_ids, self.states)

    def discard(self) -> None:
        pass  # an in-process tensor: freed with the request


@dataclass
class Request:
    request_id: str
    prompt_tokens: list[int]  # the whole decoder prompt, <|startofprev|> ... <|notimestamps|>
    sot_index: int  # position of <|startoftranscript|> in prompt_tokens
    max_tokens: int
    options: DecodeOptions
    cross_source: CrossKVSource | None
    detect_language: bool = False  # prompt_tokens[sot_index + 1] is a placeholder until detected
    priority: Priority = Priority.INTERACTIVE

    status: RequestStatus = RequestStatus.WAITING
    # time.monotonic() since which it has waited: for admission, or (batch work) to run a step. Batch aging counts it.
    waiting_since_s: float = 0.0
    blocks: RequestBlocks = field(default_factory=RequestBlocks)
    num_computed_tokens: int = 0  # tokens whose K/V sit (or are being written) in the self-attention blocks
    # Fed at the next step. The first may be FROM_LAST_STEP: the token the last launched step
    # produced at row ``pending_source_row`` (sampled, or the detected language), not read yet.
    pending_tokens: list[int] = field(default_factory=list)
    pending_source_row: int = -1
    unread_tokens: int = 0  # tokens sampled in launched steps that the host has not read yet
    launched_in: int = -1  # the last step launched with this request in it
    epoch: int = 0  # bumped when the window starts again (fallback): rows launched before are stale
    output_tokens: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float | None = None
    language: str | None = None
    generator: torch.Generator | None = None
    temperature: float = 0.0  # of the current attempt: options.temperatures()[attempt]
    attempt: int = 0  # how many times fallback has restarted this window
    audio_duration_s: float | None = None  # of the window's audio, for word alignment; None: 30 s
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_retriable: bool = False

    @property
    def fed_from_row(self) -> int:
        """The row of the last launched step whose token the first pending token is, or -1 (known here)."""
        return self.pending_source_row if self.pending_tokens[:1] == [FROM_LAST_STEP] else -1

    @property
    def max_total_tokens(self) -> int:
        # Word alignment re-reads the text with <|notimestamps|> and <|endoftext|>: one more token.
        return len(self.prompt_tokens) + self.max_tokens + (1 if self.options.word_timestamps else 0)


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
