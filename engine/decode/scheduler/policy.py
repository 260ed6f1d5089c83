"""Continuous batching: who joins, who runs, who leaves, at every decoder step.

Admission reserves the worst case. A request is admitted only when the pool can give it all its
cross-attention blocks and self-attention blocks for its prompt plus ``max_tokens``; Whisper's
448-token text context caps that at 4 blocks of 128 beside the 12 cross blocks it needs anyway,
so reserving costs little memory, and in exchange no running request can ever run out of blocks:
no preemption, no recomputation, no deadlock when the pool is full. Waiting requests are admitted
in order (the next one waits for room rather than being overtaken, so large prompts cannot
starve); every step runs every admitted request, so a short request never waits for a long one
to finish.

Priorities decide which waiting request is admitted next (engine/decode/scheduler/admission.py:
interactive first, batch work owed ``batch_share`` of the slots, reserved slots, aging); every
admitted request runs at every step.

A window decoded as several hypotheses (beams, or best-of samples: engine/decode/search/base.py)
reserves one copy of its cross-attention blocks, the most hypotheses any of its attempts decodes
worth of self-attention blocks, its prompt's blocks, and one block more per hypothesis (a spare
for choices made on the device: engine/decode/step/beam_choice.py); it counts as that many sequences
against ``max_num_seqs``, and steps its hypotheses, each a row of the batch.

An admitted request whose cross-attention K/V is still loading (a pull beside the loop, see
engine/decode/kv_loader.py) holds its blocks and sits out the steps until it has landed.

After a step is read, ``update_from_output`` appends each row's token to its request (a search
whose choice the step made on the device follows it from the device's ranking, not row by row) and
says which requests reached a stop (end of text, their length, or an error: logits that are not
finite numbers); the engine decides whether such a request restarts (fallback) or finishes. A request
finished while a step launched with it is still on the device keeps its blocks until that step has
been read (``step_read``).

Time comes from an injected clock (``time.monotonic`` by default), so the policy is testable
without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.decode.batch import Batch
from engine.decode.request import Request, RequestStatus
from engine.decode.scheduler.admission import Admission
from engine.decode.scheduler.rows import LaunchedRows, StepRows
from engine.decode.search.base import Search
from engine.decode.search.beam import BeamSearch
from engine.decode.search.best_of import BestOfSamples
from engine.decode.step.output import StepOutput
from engine.errors import CacheFullError, RequestRejectedError
from engine.kv.block_pool import BlockPool, RequestBlocks, blocks_needed
from engine.kv.shared_blocks import BlockCopy
from engine.types import FinishReason, Priority

NON_FINITE_LOGITS = "the model's activations overflowed on this window (its logits are not finite numbers)"


def non_finite_logits_error(model_dtype: str) -> str:
    """What a window whose logits are not finite fails with: what happened, and a cure only where
    the deployment has one. A model in float16 overflows at 65504 where bfloat16 and float32 reach
    float32's range; one in float32 or bfloat16 has no wider precision to move to."""
    if model_dtype != "float16":
        return NON_FINITE_LOGITS
    return (
        f"{NON_FINITE_LOGITS}; this model runs in float16, whose range ends at 65504: engine.dtype "
        "bfloat16 or float32 avoids it"
    )


@dataclass
class ScheduledStep:
    admitted: list[Request]  # joined this step: their cross-attention K/V must be loaded first
    batch: list[Request]  # every sequence that runs this step (a search's hypotheses), admitted ones too
    block_copies: list[BlockCopy]  # to make before the step: hypotheses about to write into a shared block


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        cross_tokens_per_request: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        interactive_reserved_seqs: int = 0,
        batch_aging_s: float = 30.0,
        batch_share: float = 0.0,
        eot: int | None = None,
        n_text_ctx: int = 448,
        clock: Callable[[], float] = time.monotonic,
        consecutive_cross_blocks: bool = False,
        rows: StepRows | None = None,
        non_finite_error: str = NON_FINITE_LOGITS,
    ):
        """``consecutive_cross_blocks``: take each window's cross-attention blocks as one run of
        consecutive ids where the pool has one (the attention backend reads runs in place).
        ``rows``: makes each step's rows (``rows_to_step``). ``non_finite_error``: what a window
        whose logits are not finite fails with (``non_finite_logits_error``)."""
        self.pool = pool
        self.non_finite_error = non_finite_error
        self.rows = rows
        # Launched steps not read yet, by step id: what applying their output needs.
        self.launched: dict[int, LaunchedRows] = {}
        self.consecutive_cross_blocks = consecutive_cross_blocks
        self.eot = eot  # end of text: a sampled eot stops a request (None: only length stops)
        self.n_text_ctx = n_text_ctx
        self.clock = clock
        self.window_frames = cross_tokens_per_request  # a full window's; a request may carry fewer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission = Admission(max_num_seqs, interactive_reserved_seqs, batch_aging_s, batch_share)
        self.waiting: list[Request] = []  # in arrival order
        self.running: list[Request] = []
        self.last_read_step = -1  # steps launched after it may still be on the device
        self._held: list[Request] = []  # finished, their blocks held until their last step is read

    def blocks_for(self, request: Request) -> int:
        self_blocks = blocks_needed(request.max_total_tokens, self.pool.block_size)
        if request.options.max_hypotheses > 1:
            # Each hypothesis's worst case, the prompt's blocks, held for a fallback restart, and a
            # spare each for choices made on the device (engine/decode/step/beam_choice.py), whose
            # children take spares while their parents still hold every block. Enough: where a
            # choice's write starts a block, the k parents hold at most k * (B - 1) of the k * B
            # blocks besides the prompt's, and k children take a spare; elsewhere they hold at most
            # k * B and at most k - 1 children (not the last of each parent) take one.
            prompt_blocks = blocks_needed(len(request.prompt_tokens), self.pool.block_size)
            self_blocks = (self_blocks + 1) * request.options.max_hypotheses + prompt_blocks
        return self.cross_blocks_of(request) + self_blocks

    def cross_frames_of(self, request: Request) -> int:
        """The encoder frames the request's cross blocks are to hold: its source's, or a full window's.
        Asked until the blocks are allocated, while the source is still attached; from then on the
        blocks' own cross_len holds the number."""
        return self.window_frames if request.cross_source is None else request.cross_source.num_frames

    def cross_blocks_of(self, request: Request) -> int:
        return blocks_needed(self.cross_frames_of(request), self.pool.block_size)

    @property
    def num_sequences(self) -> int:
        """Sequences running: a window decoded as several hypotheses counts each of them."""
        return sum(request.options.max_hypotheses for request in self.running)

    def add(self, request: Request, submitted_s: float | None = None) -> None:
        """A request submitted at ``submitted_s`` (the clock's reading; None: now) waits for admission;
        raises when it can never be admitted."""
        request.submitted_s = self.clock() if submitted_s is None else submitted_s
        hypotheses = request.options.max_hypotheses
        if hypotheses > self.max_num_seqs:
            raise RequestRejectedError(
                f"beam_size or best_of {hypotheses} is more than this decoder runs at once "
                f"(max_num_seqs {self.max_num_seqs})",
                param="beam_size",
            )
        if self.blocks_for(request) > self.pool.num_blocks:
            raise CacheFullError(
                f"request {request.request_id} needs {self.blocks_for(request)} KV blocks, the whole "
                f"cache has {self.pool.num_blocks}: raise kv_cache_memory_mb"
            )
        request.status = RequestStatus.WAITING
        request.waiting_since_s = self.clock()
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens - sum(len(r.pending_tokens) for r in self.running)
        admitted: list[Request] = []
        now = self.clock()
        while self.waiting:
            request = self.admission.next_to_admit(self.waiting, self.running, now)
            needed = self.blocks_for(request)
            if (
                not self.admission.fits(request, needed, self.running, self.pool, now)
                or len(request.pending_tokens) > budget
            ):
                break
            self.waiting.remove(request)
            self._allocate(request, needed)
            request.status = RequestStatus.RUNNING
            # K/V written at admission lands at once; a pull lands later (``landed``).
            request.admitted_s = request.load_started_s = request.load_ended_s = request.runnable_s = now
            budget -= len(request.pending_tokens)
            self.running.append(request)
            admitted.append(request)
        batch: list[Request] = []
        copies: list[BlockCopy] = []
        for request in self.running:
            if request.cross_kv_loading:
                continue
            if request.search is None:
                batch.append(request)
            else:
                batch += request.search.hypotheses
                copies += request.search.prepare_step()
        return ScheduledStep(admitted=admitted, batch=batch, block_copies=copies)

    def rows_to_step(self, scheduled: ScheduledStep) -> Batch | None:
        """The rows of the scheduled requests that still need a step, each request moved on to
        after it (engine/decode/scheduler/rows.py); None when none does."""
        made = self.rows.of(scheduled.batch)
        if made is None:
            return None
        batch, launched = made
        self.launched[batch.step_id] = launched
        return batch

    def _allocate(self, request: Request, needed_blocks: int) -> None:
        allocate = self.pool.allocate_consecutive if self.consecutive_cross_blocks else self.pool.allocate
        cross_blocks = self.cross_blocks_of(request)
        request.blocks.cross_block_ids = allocate(cross_blocks)
        request.blocks.cross_len = self.cross_frames_of(request)
        self_block_ids = self.pool.allocate(needed_blocks - cross_blocks)
        # One table's worth as the request's own; the rest held for the hypotheses of a search.
        table_size = blocks_needed(request.max_total_tokens, self.pool.block_size)
        request.blocks.self_block_ids = self_block_ids[:table_size]
        request.blocks.spare_block_ids = self_block_ids[table_size:]
        if request.num_hypotheses > 1:
            self.start_search(request)

    def start_search(self, request: Request) -> None:
        """Decode the request's current attempt as several hypotheses, on its blocks: the ones
        holding the prompt's K/V so far go on holding it, the others become the search's spares."""
        table = request.blocks.self_block_ids
        prompt_block_ids = table[: blocks_needed(request.num_computed_tokens, self.pool.block_size)]
        request.blocks.spare_block_ids = table + request.blocks.spare_block_ids  # all held for the search
        request.blocks.self_block_ids = []
        kind = BeamSearch if request.temperature == 0 else BestOfSamples
        request.search = kind(request, prompt_block_ids, self.pool.block_size, self.eot, self.n_text_ctx)

    def num_waiting_of(self, priority: Priority) -> int:
        return sum(1 for request in self.waiting if request.priority == priority)

    def update_from_output(self, output: StepOutput) -> list[tuple[Request, FinishReason]]:
        """Append a read step's tokens to their requests; return the requests that reached a stop."""
        stopped: list[tuple[Request, FinishReason]] = []
        offered: dict[Search, list[int]] = {}  # a search's rows that offered candidates
        launched = self.launched.pop(output.step_id)
        # Locals: the loop runs once per row of the step read token by token.
        batch, epochs, computed_after, tokens, logprobs, step_id = (
            launched.requests,
            launched.epochs,
            launched.computed_after,
            output.tokens,
            output.logprobs,
            output.step_id,
        )
        no_speech_probs, languages, sampled_rows, nonfinite = (
            output.no_speech_probs,
            output.languages,
            output.sampled_rows,
            output.nonfinite_rows,
        )
        finished, eot = RequestStatus.FINISHED, self.eot
        for row in range(len(batch)) if output.host_rows is None else output.host_rows:
            request = batch[row]
            if request.status is finished or request.epoch != epochs[row]:
                continue  # ended, or started again, since: the row is stale
            token = tokens[row]
            if no_speech_probs and row in no_speech_probs:
                request.no_speech_prob = no_speech_probs[row]
            if languages and row in languages:
                request.language = languages[row]
                request.prompt_tokens[request.sot_index + 1] = token
            if request.launched_in == step_id and request.fed_from_row >= 0:
                request.pending_tokens[0] = token  # no later step ran it: the next one takes it from the host
            if row not in sampled_rows:
                continue
            request.unread_tokens -= 1
            search = request.hypothesis_of
            if nonfinite and row in nonfinite:
                self._fail_non_finite(search.window if search is not None else request, stopped)
                continue
            if search is not None:
                rows = offered.get(search)
                if rows is None:
                    offered[search] = [row]
                else:
                    rows.append(row)
                continue
            logprob = logprobs[row]
            request.sum_logprob += logprob
            if token == eot and not request.options.ignore_eot:
                stopped.append((request, FinishReason.STOP))
                continue
            request.output_tokens.append(token)
            request.output_logprobs.append(logprob)
            full = computed_after[row] + 1 >= self.n_text_ctx
            if len(request.output_tokens) >= request.max_tokens or full:
                stopped.append((request, FinishReason.LENGTH))
        for search, rows in offered.items():
            if search.window.error is None:
                offers = output.candidates.select([output.candidate_index[row] for row in rows])
                if search.update([batch[row] for row in rows], offers):
                    stopped.append((search.window, search.finish()))
        rankings = output.device_rankings
        if rankings is not None:
            ranks, every_rank, overflowed = rankings.first_ranks, rankings.every_rank, rankings.overflowed
            for index, search in enumerate(launched.device_searches):
                if search.hypotheses[0].status is finished:
                    continue  # the search ended since (its window finished, or started again)
                if overflowed[index]:
                    self._fail_non_finite(search.window, stopped)
                if search.window.error is None and search.follow_device_choice(
                    ranks, index, every_rank.get(index), step_id
                ):
                    stopped.append((search.window, search.finish()))
        return stopped

    def _fail_non_finite(self, window: Request, stopped: list[tuple[Request, FinishReason]]) -> None:
        """NaN or infinite logits: the activations overflowed. The token would be garbage; fail the
        window in words instead."""
        if window.error is None:
            window.error = self.non_finite_error
            stopped.append((window, FinishReason.ERROR))

    @staticmethod
    def hold_for_load(request: Request) -> None:
        """Its K/V is on its way into its blocks (engine/decode/kv_loader.py): it sits out the steps."""
        request.cross_kv_loading = True

    def landed(self, request: Request, load_started_s: float, load_ended_s: float) -> None:
        """Its K/V load has ended (landed, or failed) after running from ``load_started_s`` to
        ``load_ended_s`` on a loader worker: it may step, and its blocks may go back."""
        request.cross_kv_loading = False
        request.load_started_s, request.load_ended_s = load_started_s, load_ended_s
        request.runnable_s = self.clock()

    @property
    def has_runnable(self) -> bool:
        """Whether a running request can take a step (its K/V has landed)."""
        return any(not request.cross_kv_loading for request in self.running)

    def step_read(self, step_id: int) -> None:
        """Step ``step_id`` (and every one before it) has run: blocks held for it go back."""
        self.last_read_step = step_id
        self.release_held()

    def release_held(self) -> None:
        """Give back the blocks of finished requests that nothing writes any more."""
        still_held = []
        for request in self._held:
            if self._blocks_in_use(request):
                still_held.append(request)
            else:
                self.release_blocks(request)
        self._held = still_held

    def _blocks_in_use(self, request: Request) -> bool:
        """A step launched with it and not read yet, or its K/V load, may still write its blocks."""
        return request.launched_in > self.last_read_step or request.cross_kv_loading

    def finish(
        self, request: Request, reason: FinishReason, error: str | None = None, retriable: bool = False
    ) -> None:
        """Take a request out, wherever it is, and return its blocks; safe to call once per request.
        ``error``: why it failed, in words (``retriable``: the same request may succeed again).

        If a step launched with it has not been read yet, or its K/V is still loading, something may
        still write its blocks: they are held until ``step_read`` or ``release_held`` finds nothing does."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:  # (one refused by ``add`` never joined)
            self.waiting.remove(request)
        if self._blocks_in_use(request):
            self._held.append(request)
        else:
            self.release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if error is not None:
            request.error, request.error_retriable = error, retriable
        request.cross_source = None  # drop the K/V it came with

    def release_blocks(self, request: Request) -> None:
        self.pool.free(request.blocks.all_ids())
        request.blocks = RequestBlocks()
