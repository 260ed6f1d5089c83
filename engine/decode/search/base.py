"""A window decoded as several hypotheses at once: beam search at temperature 0, or best-of-n
samples at a higher temperature (engine/decode/search/beam.py, engine/decode/search/best_of.py), as
openai-whisper's BeamSearchDecoder and its sampling with ``best_of`` decide.

The window's prompt runs once, as its first hypothesis. Each hypothesis is a sequence of the decode
loop with a block-table slot of its own; all of them read the window's one copy of the
cross-attention K/V, and they share self-attention blocks by reference count: a hypothesis
continued by several others is forked (its blocks shared), and a block is copied only when one of
them is about to write into a block another still holds (engine/kv/shared_blocks.py). Each step,
every live hypothesis offers candidates for its next token (its likeliest tokens, or its draws);
the search picks what continues, and the hypotheses that reach end of text join the finished. When
the search is over, the finished hypothesis with the best sum of log-probabilities over its length
(or the length penalty of Google's NMT paper) is the window's text (openai-whisper's
MaximumLikelihoodRanker).

A search's first choice (one hypothesis to several) and best-of samples' choices are made on the
host, so a step with such a choice is read before the next is launched. A beam search's later
choices are made on the device with async steps (engine/decode/step/beam_choice.py), its last one
by length included: the next step launches before the host has read the last, and the host
follows each choice one step late from the device's ranking of the candidates
(``follow_device_choice``); its texts and sums follow those choices when the host next reads them
(a text ending, the search's end). From the first choice on the device to the search's end, the
hypotheses' block tables are the device's: the host's copies of them, and its reference counts,
are left as they were at its last choice, and nothing reads them again.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

from engine.decode.request import Request, RequestStatus
from engine.decode.step.output import Candidates, FirstRanks, Ranking
from engine.kv.block_pool import RequestBlocks, blocks_needed
from engine.kv.shared_blocks import BlockCopy, SharedBlocks
from engine.types import FinishReason


class Choice(NamedTuple):
    """A sequence the search may go on with: a parent hypothesis's tokens and one more. (A tuple,
    not a data class: a step makes several per hypothesis, on the host's critical path.)"""

    parent: int  # index of the hypothesis it continues
    token: int
    logprob: float  # of ``token``
    sum_logprob: float


class Search:
    def __init__(
        self, window: Request, prompt_block_ids: list[int], block_size: int, eot: int, n_text_ctx: int
    ):
        self.window = window
        self.eot = eot
        # The token that ends a text, or -1 (none) when the window ignores end of text.
        self.text_end = -1 if window.options.ignore_eot else eot
        # The most tokens a hypothesis's text may have: the window's limit, or what the text context
        # leaves after its prompt (whose length a detected language does not change).
        self.max_text_length = min(window.max_tokens, n_text_ctx - len(window.prompt_tokens))
        self.length_penalty = window.options.length_penalty
        self.blocks = SharedBlocks(window.blocks.spare_block_ids, block_size, in_use=prompt_block_ids)
        self.self_blocks_per_hypothesis = blocks_needed(window.max_total_tokens, block_size)
        first = self._hypothesis(0, window)
        first.start_hypothesis(list(prompt_block_ids))
        self.hypotheses: list[Request] = [first]
        self.retired: list[Request] = []  # hypotheses with nothing left to continue: slots to give back
        self.finished: dict[tuple[int, ...], tuple[float, tuple[float, ...]]] = {}  # tokens + eot -> sums
        self.prompt_block_ids: list[int] = []  # the prompt's blocks, held at the first fork for a restart
        # Whether the host made the last choice: then the hypotheses' block tables, timestamp
        # histories and sums go to the device at the next launch; after a choice on the device they
        # are there already, and the block tables are the device's alone (the module's docstring).
        self.host_chose_last = True
        # Once the device chooses, the hypotheses are at one position, launched in the same steps,
        # with as many tokens unread, each fed from the row after the one before's: from then on
        # only the first one's num_computed_tokens, launched_in, unread_tokens, pending tokens
        # and source row are kept up to date, and they stand for all of them (at many beams the
        # host's work per row is what bounds a step). The others' are left as they were.
        self._reserved_for_device: list[int] = []  # the blocks the device may hand out as spares
        # The device's choices followed and not applied to the texts yet, oldest first: the
        # step's first ranks and this search's row of them.
        self._trail: list[tuple[FirstRanks, int]] = []

    def candidates_wanted(self, hypothesis: Request) -> int:
        """How many candidate tokens the hypothesis offers this step."""
        raise NotImplementedError

    def update(self, hypotheses: list[Request], offers: Candidates) -> bool:
        """Take a step's candidates (row i offered by ``hypotheses[i]``); returns whether the
        search is over."""
        raise NotImplementedError

    def follow_device_choice(
        self, ranks: FirstRanks, row: int, every_rank: Ranking | None, step_id: int
    ) -> bool:
        """What the choice the device made in step ``step_id`` did (``launch_device_choice``), from
        its ranking of the candidates: row ``row`` of the step's first ranks, and where a text may
        end among them, its every rank. The step is read, for all of its hypotheses (the scheduler
        does not read their rows one by one); returns whether the search is over."""
        raise NotImplementedError

    def chooses_on_device(self) -> bool:
        """Whether the step being launched may make this search's choice on the device (once it
        does, it makes every later one: the module's docstring)."""
        return False

    def launch_device_choice(self) -> list[int]:
        """The step being launched makes this search's choice on the device. Returns the blocks it
        may hand out as spares: the window's reservation but the prompt's blocks, held for a
        restart (no hypothesis writes those)."""
        if self.host_chose_last:
            held = set(self.prompt_block_ids)
            self._reserved_for_device = [b for b in self.blocks.reserved_block_ids if b not in held]
        self.host_chose_last = False
        return self._reserved_for_device

    def _unfinished_to_rank(self, finished: dict) -> list[Request]:
        """Live hypotheses ranked beside the finished ones when the search ends (at its length)."""
        raise NotImplementedError

    def _hypothesis(self, index: int, like: Request) -> Request:
        """A copy of ``like``'s state with a slot of its own, reading the window's cross-attention blocks."""
        return dataclasses.replace(
            like,
            request_id=f"{self.window.request_id}#{index}",
            blocks=RequestBlocks(
                cross_block_ids=self.window.blocks.cross_block_ids, cross_len=self.window.blocks.cross_len
            ),
            prompt_tokens=list(like.prompt_tokens),
            pending_tokens=list(like.pending_tokens),
            output_tokens=list(like.output_tokens),
            output_logprobs=list(like.output_logprobs),
            status=RequestStatus.RUNNING,
            search=None,
            hypothesis_of=self,
        )

    def prepare_step(self) -> list[BlockCopy]:
        """Blocks for what each hypothesis writes this step; the copies a write into a shared block
        needs. None after a choice on the device: it gave each hypothesis a block of its own."""
        if not self.host_chose_last:
            return []
        copies: list[BlockCopy] = []
        for hypothesis in self.hypotheses:
            table = hypothesis.blocks.self_block_ids
            size = len(table)
            start = hypothesis.num_computed_tokens
            made = self.blocks.prepare_write(table, start, start + len(hypothesis.pending_tokens))
            if made or len(table) != size:  # a block copied, or one more taken
                hypothesis.blocks_changed()
                copies += made
        return copies

    def _parents_of(self, hypotheses: list[Request]) -> list[int] | range:
        """Each offering hypothesis's index in ``self.hypotheses`` (usually all of them, in order)."""
        if len(hypotheses) == len(self.hypotheses) and all(map(operator.is_, hypotheses, self.hypotheses)):
            return range(len(hypotheses))
        index_of = {id(hypothesis): index for index, hypothesis in enumerate(self.hypotheses)}
        return [index_of[id(hypothesis)] for hypothesis in hypotheses]

    def _finish_sequence(self, choice: Choice) -> None:
        """Call before ``_continue_with``: it reuses the parents' lists."""
        parent = self.hypotheses[choice.parent]
        self.finished[(*parent.output_tokens, choice.token)] = (
            choice.sum_logprob,
            (*parent.output_logprobs, choice.logprob),
        )

    def _continue_with(self, chosen: list[Choice]) -> bool:
        """The chosen sequences become the hypotheses, each on its parent's blocks (shared); returns
        whether the search has reached the window's length."""
        if not self.host_chose_last:
            # The device's block tables are not the host's: a search the device chooses for stays so.
            raise RuntimeError("a search chose on the host after choosing on the device")
        if not self.prompt_block_ids:
            # The prompt's K/V stays for a fallback restart; no hypothesis may write over it.
            self.prompt_block_ids = self.blocks.fork(self.hypotheses[0].blocks.self_block_ids)
        parents = [(h.output_tokens, h.output_logprobs, h.blocks.self_block_ids) for h in self.hypotheses]
        # A parent's first continuation takes over its lists (appending to them) and its hold on its
        # blocks; any other continuation copies them, before anything is appended. Copying every
        # hypothesis's text every step would cost the host time in proportion to its length.
        continued: set[int] = set()
        copied: list[tuple[list[int], list[float], list[int]] | None] = []
        for choice in chosen:
            tokens, logprobs, table = parents[choice.parent]
            if choice.parent in continued:
                copied.append(([*tokens, choice.token], [*logprobs, choice.logprob], self.blocks.fork(table)))
            else:
                continued.add(choice.parent)
                copied.append(None)
        for index, (_, _, table) in enumerate(parents):
            if index not in continued:
                self.blocks.drop(table)
        while len(self.hypotheses) < len(chosen):
            self.hypotheses.append(self._hypothesis(len(self.hypotheses), self.hypotheses[0]))
        computed = self.hypotheses[0].num_computed_tokens
        for hypothesis, choice, copy in zip(self.hypotheses, chosen, copied):
            if copy is None:
                tokens, logprobs, table = parents[choice.parent]
                tokens.append(choice.token)
                logprobs.append(choice.logprob)
            else:
                tokens, logprobs, table = copy
            hypothesis.go_on_with(tokens, logprobs, choice.sum_logprob, table, computed)
        for hypothesis in self.hypotheses[len(chosen) :]:
            hypothesis.retire()
        self.retired += self.hypotheses[len(chosen) :]
        del self.hypotheses[len(chosen) :]
        return self._at_length(len(self.hypotheses[0].output_tokens) if chosen else 0)

    def _at_length(self, length: int) -> bool:
        """Whether hypotheses of ``length`` tokens have reached the window's length."""
        return length >= self.max_text_length

    def _follow_device_choice(self, ranks: FirstRanks, row: int, step_id: int) -> bool:
        """What the device did with the choice it made in step ``step_id``, on the host: the chosen
        sequences (child ``j`` continues hypothesis ``ranks.parent[row, j]`` with its token)
        become the hypotheses (each one's row, slot and next token stay as launched; the device
        moved the blocks). The texts and sums follow only when the host reads them
        (``_texts_up_to_date``): a step followed here is a few list operations. Returns whether
        the search has reached the window's length."""
        hypotheses = self.hypotheses
        self._trail.append((ranks, row))
        if hypotheses[0].launched_in == step_id:  # no later step took the tokens from the device
            # Every hypothesis's: the next step feeds each its own (engine/decode/scheduler/rows.py).
            tokens = ranks.token[row, : len(hypotheses)].tolist()
            hypotheses[0].read_device_choice(tokens[0])  # the first stands for all (``__init__``)
            for hypothesis, token in zip(hypotheses[1:], tokens[1:]):
                hypothesis.feed_next(token)
        else:
            hypotheses[0].read_device_choice(None)
        return self._at_length(self.text_length())

    def ends_with(self, unread_tokens: int) -> bool:
        """Whether the hypotheses' texts reach the window's length with their ``unread_tokens``
        (sampled in launched steps, not read yet): then they need no further step."""
        return unread_tokens > 0 and self._at_length(self.text_length() + unread_tokens)

    def text_length(self) -> int:
        """How many tokens each hypothesis's text has (they all have as many)."""
        return len(self.hypotheses[0].output_tokens) + len(self._trail)

    def _texts_up_to_date(self) -> None:
        """Bring the hypotheses' texts, log-probabilities and sums up to the device's choices
        followed since (``_trail``): each hypothesis's tokens since, found by walking back through
        its parents, after the text of the hypothesis it descends from."""
        trail = self._trail
        if not trail:
            return
        hypotheses = self.hypotheses
        k = len(hypotheses)
        steps = [
            (ranks.parent[row, :k].tolist(), ranks.token[row, :k].tolist(), ranks.logprob[row, :k].tolist())
            for ranks, row in reversed(trail)
        ]
        texts = [(hypothesis.output_tokens, hypothesis.output_logprobs) for hypothesis in hypotheses]
        followed: list[tuple[list[int], list[float]]] = []
        for child in range(k):
            tokens, logprobs, index = [], [], child
            for parents, step_tokens, step_logprobs in steps:
                tokens.append(step_tokens[index])
                logprobs.append(step_logprobs[index])
                index = parents[index]
            tokens.reverse()
            logprobs.reverse()
            followed.append((texts[index][0] + tokens, texts[index][1] + logprobs))
        last, row = trail[-1]
        for hypothesis, (tokens, logprobs), total in zip(
            hypotheses, followed, last.sum_logprob[row, :k].tolist()
        ):
            hypothesis.follow_texts(tokens, logprobs, total)
        trail.clear()

    def finish(self) -> FinishReason:
        """The best hypothesis becomes the window's text (openai-whisper's finalize and ranking)."""
        self._texts_up_to_date()
        finished = dict(self.finished)
        for hypothesis in self._unfinished_to_rank(finished):
            finished[(*hypothesis.output_tokens, self.eot)] = (
                hypothesis.sum_logprob,
                tuple(hypothesis.output_logprobs),
            )
        best = max(finished, key=lambda tokens: self._rank_score(tokens, finished[tokens][0]))
        sum_logprob, logprobs = finished[best]
        text = list(best[:-1] if best[-1] == self.eot else best)
        first = (self.hypotheses + self.retired)[0]
        self.window.take_search_result(text, list(logprobs[: len(text)]), sum_logprob, first)
        return FinishReason.STOP if best in self.finished else FinishReason.LENGTH

    def _rank_score(self, tokens: tuple[int, ...], sum_logprob: float) -> float:
        length = max(1, len(tokens) - (1 if tokens[-1] == self.eot else 0))
        penalty = length if self.length_penalty is None else ((5 + length) / 6) ** self.length_penalty
        return sum_logprob / penalty

    def end(self, keep_prompt: bool) -> list[Request]:
        """The search is over: the window takes back its blocks as one table (its prompt's blocks
        first when ``keep_prompt``: a fallback restart decodes on them). Returns every hypothesis
        it ran, whose slots are to be given back."""
        every = self.hypotheses + self.retired
        for hypothesis in every:
            hypothesis.end_hypothesis()
        first = self.prompt_block_ids if keep_prompt else []
        kept = set(first)
        rest = [block_id for block_id in self.window.blocks.spare_block_ids if block_id not in kept]
        table_size = self.self_blocks_per_hypothesis
        # A step launched with a hypothesis and not read yet may still write the window's blocks (the
        # first hypothesis's launched_in is the latest: it stands for all once the device chooses).
        self.window.end_search(
            max(hypothesis.launched_in for hypothesis in every),
            first + rest[: table_size - len(first)],
            rest[table_size - len(first) :],
        )
        return every
