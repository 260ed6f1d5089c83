"""A window's state inside the decode loop: its prompt, blocks, tokens so far and async-step
bookkeeping. Built by the engine from DecodeOptions, never handed across the package boundary,
nor to the step side (it gets a Batch of rows: engine/decode/batch.py). The scheduler
(engine/decode/scheduler/) writes it, with the searches it runs on their hypotheses; the loop's
other pieces read it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.decode.batch import FROM_LAST_STEP
from engine.kv.block_pool import RequestBlocks
from engine.kv.sources import CrossKVSource
from engine.types import DecodeOptions, FinishReason, Priority


class WindowSearch(Protocol):
    """What a request knows of the search that decodes its window as several hypotheses
    (engine/decode/search/ holds the searches; they import this module, not it them)."""

    window: Request
    hypotheses: list[Request]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_tokens: list[int]  # the whole decoder prompt, <|startofprev|> ... <|notimestamps|>
    sot_index: int  # position of <|startoftranscript|> in prompt_tokens
    max_tokens: int
    options: DecodeOptions
    # Its cross-attention K/V until it finishes: its num_frames sizes the cross blocks, and from their
    # allocation RequestBlocks.cross_len says what they hold. None: a request built only to check its
    # options or to size a full window's blocks, never submitted.
    cross_source: CrossKVSource | None
    detect_language: bool = False  # prompt_tokens[sot_index + 1] is a placeholder until detected
    priority: Priority = Priority.INTERACTIVE

    status: RequestStatus = RequestStatus.WAITING
    # time.monotonic() since which it has waited: for admission, or (batch work) to run a step. Batch
    # aging counts it.
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
    cross_kv_loading: bool = False  # its K/V is on its way into its blocks: it sits out the steps
    output_tokens: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    output_logprobs: list[float] = field(default_factory=list)  # one per output token
    no_speech_prob: float | None = None
    language: str | None = None
    generator: torch.Generator | None = None
    temperature: float = 0.0  # of the current attempt: options.temperatures()[attempt]
    attempt: int = 0  # how many times fallback has restarted this window
    audio_duration_s: float | None = None  # of the window's audio, for word alignment; None: 30 s
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_retriable: bool = False
    # A window decoded as several hypotheses (beams, or best-of samples): its search while it runs
    # (the hypotheses are what steps).
    search: WindowSearch | None = field(default=None, repr=False, compare=False)
    # A hypothesis: the search it belongs to; its self-attention blocks change as hypotheses fork.
    hypothesis_of: WindowSearch | None = field(default=None, repr=False, compare=False)
    tables_changed: bool = False  # its blocks changed since its block-table row was written
    # time.monotonic() when it was submitted, admitted, its K/V load began and ended on a loader
    # worker (both at admission for K/V written in place), and it could first step (the loop saw the
    # load end): the engine sums the stretches between them (engine/decode/timings.py).
    submitted_s: float = 0.0
    admitted_s: float = 0.0
    load_started_s: float = 0.0
    load_ended_s: float = 0.0
    runnable_s: float = 0.0

    @property
    def fed_from_row(self) -> int:
        """The row of the last launched step whose token the first pending token is, or -1 (known here)."""
        pending = self.pending_tokens
        return self.pending_source_row if pending and pending[0] == FROM_LAST_STEP else -1

    @property
    def num_hypotheses(self) -> int:
        """Sequences its current attempt steps at once: beams at temperature 0, best-of samples
        above it (as openai-whisper's transcribe uses beam_size and best_of)."""
        return self.options.hypotheses_at(self.temperature)

    @property
    def max_total_tokens(self) -> int:
        # Word alignment re-reads the text with <|notimestamps|> and <|endoftext|>: one more token.
        return len(self.prompt_tokens) + self.max_tokens + (1 if self.options.word_timestamps else 0)

    # What a search (engine/decode/search/) does to the sequences it runs: the scheduler runs the
    # searches, and they change a request only through these methods.

    def start_hypothesis(self, self_block_ids: list[int]) -> None:
        """This copy of a window is a search's first hypothesis, on the prompt's ``self_block_ids``."""
        self.blocks.self_block_ids = self_block_ids

    def sample_with(self, generator: torch.Generator) -> None:
        self.generator = generator

    def go_on_with(
        self,
        tokens: list[int],
        logprobs: list[float],
        sum_logprob: float,
        self_block_ids: list[int],
        num_computed_tokens: int,
    ) -> None:
        """A search chose this hypothesis's text: ``tokens`` (their ``logprobs``, summing to
        ``sum_logprob``) on ``self_block_ids``; its last token is fed next, at ``num_computed_tokens``.
        The lists are taken over, not copied."""
        self.output_tokens, self.output_logprobs, self.sum_logprob = tokens, logprobs, sum_logprob
        # Its block-table row is rewritten only if its blocks are not the ones already there.
        previous = self.blocks.self_block_ids
        self.tables_changed |= self_block_ids is not previous and self_block_ids != previous
        self.blocks.self_block_ids = self_block_ids
        self.num_computed_tokens = num_computed_tokens
        self.pending_tokens = [tokens[-1]]
        self.unread_tokens = 0

    def blocks_changed(self) -> None:
        """Its self-attention blocks changed (one copied, or one more taken): its table row is rewritten."""
        self.tables_changed = True

    def retire(self) -> None:
        """A hypothesis the search does not continue: it gives up its blocks and its text (whose lists
        another hypothesis may have taken over)."""
        self.status, self.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
        self.blocks.self_block_ids = []
        self.output_tokens, self.output_logprobs = [], []

    def end_hypothesis(self) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, FinishReason.STOP

    def read_device_choice(self, next_token: int | None) -> None:
        """A search's choice made on the device was followed: one unread token fewer, and where no
        later step has taken it from the device, ``next_token`` is fed next."""
        self.unread_tokens -= 1
        if next_token is not None:
            self.pending_tokens = [next_token]

    def feed_next(self, token: int) -> None:
        self.pending_tokens = [token]

    def follow_texts(self, tokens: list[int], logprobs: list[float], sum_logprob: float) -> None:
        """The text the device's choices gave this hypothesis since the host last read them."""
        self.output_tokens, self.output_logprobs, self.sum_logprob = tokens, logprobs, sum_logprob

    def take_search_result(
        self, tokens: list[int], logprobs: list[float], sum_logprob: float, first: Request
    ) -> None:
        """The search over this window ended with ``tokens`` as its text; the prompt, language and
        no-speech probability its ``first`` hypothesis detected are the window's."""
        self.output_tokens, self.output_logprobs, self.sum_logprob = tokens, logprobs, sum_logprob
        self.prompt_tokens, self.detect_language = first.prompt_tokens, False
        self.language, self.no_speech_prob = first.language, first.no_speech_prob

    def end_search(self, launched_in: int, self_block_ids: list[int], spare_block_ids: list[int]) -> None:
        """Its search is over: the window takes its blocks back as one table (and spares), and counts
        as launched in the latest step any of its hypotheses was."""
        self.launched_in = max(self.launched_in, launched_in)
        self.blocks.self_block_ids = self_block_ids
        self.blocks.spare_block_ids = spare_block_ids
        self.search = None

    def start_again(self, temperature: float, undo_draw: torch.Tensor | None) -> None:
        """The window's next attempt (fallback): its text starts again at ``temperature`` on the
        blocks it holds (the prompt's K/V stays, so only the last prompt token is fed again); rows
        launched before are stale. ``undo_draw``: its generator's state before a draw made by a step
        launched after the one that ended it, restored so the attempt samples as it would have."""
        if undo_draw is not None:
            self.generator.set_state(undo_draw)
        self.attempt += 1
        self.epoch += 1
        self.temperature = temperature
        self.output_tokens, self.sum_logprob, self.unread_tokens = [], 0.0, 0
        self.output_logprobs = []
        self.num_computed_tokens = len(self.prompt_tokens) - 1
        self.pending_tokens = self.prompt_tokens[-1:]
