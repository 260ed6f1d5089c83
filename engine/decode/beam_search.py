"""Beam search for one window, with openai-whisper's semantics (whisper/decoding.py,
BeamSearchDecoder and MaximumLikelihoodRanker), on blocks the window's beams share.

The window's prompt runs once, as its first hypothesis. At every step after that each live
hypothesis offers its ``beam_size + 1`` likeliest next tokens (log-probabilities of the logits
after Whisper's rules); the candidates are ranked by their sum of log-probabilities, those ending
at end of text join the finished ones, and the best ``beam_size`` others are the next step's
hypotheses. A hypothesis continued by several of them is forked: they share its self-attention
blocks and copy only a block one of them writes into (engine/kv/shared_blocks.py); all of them
read the window's one copy of the cross-attention K/V. The search ends when ``beam_size *
patience`` hypotheses have finished, or at the window's length; the finished hypothesis with the
best sum of log-probabilities over its length (or the length penalty of Google's NMT paper) is
the window's text.

The choice needs every candidate on the host, so a step with beams in it is read before the next
is launched (the engine does not run a step ahead while beams run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from engine.decode.request import Request, RequestStatus
from engine.kv.block_pool import RequestBlocks, blocks_needed
from engine.kv.shared_blocks import BlockCopy, SharedBlocks
from engine.types import FinishReason


@dataclass(frozen=True)
class BeamCandidates:
    """What a step read back for one hypothesis: its likeliest next tokens, best first."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class _Hypothesis:
    """A hypothesis's text so far, as a step found it (hypotheses are reassigned every step)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    sum_logprob: float
    self_block_ids: list[int]


def _f32_sum(a: float, b: float) -> float:
    # openai-whisper keeps the sums in a float32 tensor: the same rounding keeps near-ties alike.
    return float(np.float32(a) + np.float32(b))


class BeamSearch:
    def __init__(self, window: Request, block_size: int, eot: int, n_text_ctx: int):
        options = window.options
        self.window = window
        self.beam_size = options.beam_size
        # openai-whisper: finish once beam_size * patience hypotheses have ended.
        self.max_finished = max(1, round(options.beam_size * (options.patience or 1.0)))
        self.length_penalty = options.length_penalty
        self.eot = eot
        self.n_text_ctx = n_text_ctx
        self.blocks = SharedBlocks(window.blocks.spare_block_ids, block_size)
        self.self_blocks_per_hypothesis = blocks_needed(window.max_total_tokens, block_size)
        self.hypotheses: list[Request] = [self._hypothesis(0, window)]
        self.finished: dict[tuple[int, ...], tuple[float, tuple[float, ...]]] = {}
        self.prompt_block_ids: list[int] = []  # the prompt's blocks, held for a fallback restart

    def _hypothesis(self, index: int, like: Request) -> Request:
        """A sequence of the decode loop, with a block-table slot of its own, reading the window's
        cross-attention blocks; a copy of ``like``'s state."""
        return dataclasses.replace(
            like,
            request_id=f"{self.window.request_id}#beam{index}",
            blocks=RequestBlocks(cross_block_ids=self.window.blocks.cross_block_ids),
            prompt_tokens=list(like.prompt_tokens),
            pending_tokens=list(like.pending_tokens),
            output_tokens=list(like.output_tokens),
            output_logprobs=list(like.output_logprobs),
            status=RequestStatus.RUNNING,
            beam_search=None,
            hypothesis_of=self,
            generator=None,
        )

    def prepare_step(self) -> list[BlockCopy]:
        """Blocks for what each hypothesis writes this step; the copies a write into a shared block needs."""
        copies: list[BlockCopy] = []
        for hypothesis in self.hypotheses:
            table = hypothesis.blocks.self_block_ids
            before = list(table)
            start = hypothesis.num_computed_tokens
            copies += self.blocks.prepare_write(table, start, start + len(hypothesis.pending_tokens))
            hypothesis.tables_changed |= table != before
        return copies

    def update(self, candidates: list[tuple[Request, BeamCandidates]]) -> bool:
        """Rank the hypotheses' candidates and make the best ``beam_size`` the next hypotheses;
        returns whether the search is over."""
        ignore_eot = self.window.options.ignore_eot
        scores: dict[tuple[int, ...], float] = {}
        sources: dict[tuple[int, ...], tuple[int, float]] = {}
        index_of = {id(hypothesis): index for index, hypothesis in enumerate(self.hypotheses)}
        for hypothesis, offered in candidates:
            parent = index_of[id(hypothesis)]
            prefix = tuple(hypothesis.output_tokens)
            for token, logprob in zip(offered.tokens[: self.beam_size + 1], offered.logprobs):
                sequence = (*prefix, token)
                scores[sequence] = _f32_sum(hypothesis.sum_logprob, logprob)
                sources[sequence] = (parent, logprob)
        chosen: list[tuple[int, ...]] = []
        newly_finished: dict[tuple[int, ...], float] = {}
        for sequence in sorted(scores, key=scores.get, reverse=True):
            if sequence[-1] == self.eot and not ignore_eot:
                newly_finished[sequence] = scores[sequence]
            else:
                chosen.append(sequence)
                if len(chosen) == self.beam_size:
                    break
        parents = [self._snapshot(hypothesis) for hypothesis in self.hypotheses]
        for sequence in sorted(newly_finished, key=newly_finished.get, reverse=True):
            if len(self.finished) >= self.max_finished:
                break
            parent, logprob = sources[sequence]
            self.finished[sequence] = (scores[sequence], (*parents[parent].logprobs, logprob))
        self._continue_with(chosen, sources, scores, parents)
        length = len(chosen[0]) if chosen else 0
        return (
            len(self.finished) >= self.max_finished
            or length >= self.window.max_tokens
            or len(self.window.prompt_tokens) + length >= self.n_text_ctx
        )

    def _snapshot(self, hypothesis: Request) -> _Hypothesis:
        return _Hypothesis(
            tuple(hypothesis.output_tokens),
            tuple(hypothesis.output_logprobs),
            hypothesis.sum_logprob,
            hypothesis.blocks.self_block_ids,
        )

    def _continue_with(self, chosen, sources, scores, parents: list[_Hypothesis]) -> None:
        """The chosen sequences become the hypotheses: each takes its parent's blocks, shared."""
        first_fork = not self.prompt_block_ids
        if first_fork:
            # The prompt's K/V stays for a fallback restart; no hypothesis may write over it.
            self.prompt_block_ids = self.blocks.fork(self.hypotheses[0].blocks.self_block_ids)
        while len(self.hypotheses) < len(chosen):
            self.hypotheses.append(self._hypothesis(len(self.hypotheses), self.hypotheses[0]))
        tables = [self.blocks.fork(parents[sources[sequence][0]].self_block_ids) for sequence in chosen]
        for parent in parents:
            self.blocks.drop(parent.self_block_ids)
        computed = self.hypotheses[0].num_computed_tokens
        for hypothesis, sequence, table in zip(self.hypotheses, chosen, tables):
            parent, logprob = sources[sequence]
            hypothesis.output_tokens = list(sequence)
            hypothesis.output_logprobs = [*parents[parent].logprobs, logprob]
            hypothesis.sum_logprob = scores[sequence]
            hypothesis.blocks.self_block_ids = table
            hypothesis.tables_changed = True
            hypothesis.num_computed_tokens = computed
            hypothesis.pending_tokens = [sequence[-1]]
            hypothesis.unread_tokens = 0

    def finish(self) -> FinishReason:
        """The best hypothesis becomes the window's text (openai-whisper's finalize and ranking)."""
        # Best first; among equals the later one first, as numpy's argsort reversed orders them.
        live = sorted(self.hypotheses, key=lambda h: np.float32(h.sum_logprob))[::-1]
        finished = dict(self.finished)
        for hypothesis in live:
            if len(finished) >= self.beam_size:
                break
            sequence = (*hypothesis.output_tokens, self.eot)
            finished[sequence] = (hypothesis.sum_logprob, tuple(hypothesis.output_logprobs))
        best = max(finished, key=lambda sequence: self._rank_score(sequence, finished[sequence][0]))
        sum_logprob, logprobs = finished[best]
        window, first = self.window, self.hypotheses[0]
        window.output_tokens = list(best[:-1] if best[-1] == self.eot else best)
        window.output_logprobs = list(logprobs[: len(window.output_tokens)])
        window.sum_logprob = sum_logprob
        window.prompt_tokens, window.detect_language = first.prompt_tokens, False
        window.language, window.no_speech_prob = first.language, first.no_speech_prob
        return FinishReason.STOP if best in self.finished else FinishReason.LENGTH

    def _rank_score(self, sequence: tuple[int, ...], sum_logprob: float) -> float:
        length = max(1, len(sequence) - (1 if sequence[-1] == self.eot else 0))
        penalty = length if self.length_penalty is None else ((5 + length) / 6) ** self.length_penalty
        return sum_logprob / penalty

    def end(self, keep_prompt: bool) -> None:
        """The search is over: the hypotheses leave, and the window takes back its blocks as one
        table (its prompt's blocks first when ``keep_prompt``: a fallback restart decodes on them)."""
        for hypothesis in self.hypotheses:
            hypothesis.status = RequestStatus.FINISHED
            hypothesis.finish_reason = FinishReason.STOP
        window = self.window
        reserved = window.blocks.spare_block_ids
        first = self.prompt_block_ids if keep_prompt else []
        kept = set(first)
        rest = [block_id for block_id in reserved if block_id not in kept]
        table_size = self.self_blocks_per_hypothesis
        window.blocks.self_block_ids = first + rest[: table_size - len(first)]
        window.blocks.spare_block_ids = rest[table_size - len(first) :]
        window.beam_search = None
