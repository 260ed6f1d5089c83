"""What crosses the engine's boundaries: decoding options, a request in flight, its result."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from engine.kv_cache import RequestBlocks

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode one 30 s window; defaults follow openai-whisper's."""

    language: str | None = None  # None: English for .en models, detected for multilingual ones
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False
    prompt: str | None = None  # previous text, conditions the decoder (<|startofprev|> ...)
    max_tokens: int | None = None  # new tokens; None: half the text context (224), as openai-whisper
    temperature: float = 0.0
    seed: int | None = None  # for temperature > 0; None draws from torch's default generator


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


@dataclass
class CrossKVTensor:
    """Cross-attention K/V already computed in this process: [layers, 2, frames, H, D]."""

    cross_kv: torch.Tensor

    def load_into(self, runner: "ModelRunner", block_ids: list[int]) -> None:
        runner.storage.write_sequence(block_ids, self.cross_kv)


@dataclass
class EncoderStates:
    """Encoder output [frames, d_model]; the decoder side projects it to cross K/V itself."""

    states: torch.Tensor

    def load_into(self, runner: "ModelRunner", block_ids: list[int]) -> None:
        runner.write_cross_kv_from_states(block_ids, self.states)


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
    num_computed_tokens: int = 0  # tokens whose K/V sit in the self-attention blocks
    pending_tokens: list[int] = field(default_factory=list)  # fed at the next step
    output_tokens: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float | None = None
    language: str | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_retriable: bool = False

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_tokens) + self.max_tokens


@dataclass(frozen=True)
class TimedText:
    """A stretch of a window's text between two of Whisper's timestamp tokens; times in seconds
    from the window's start."""

    start_s: float
    end_s: float
    text: str
    tokens: list[int]


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
