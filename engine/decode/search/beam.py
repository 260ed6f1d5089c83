"""Beam search at temperature 0, as openai-whisper's BeamSearchDecoder: each live hypothesis offers
its ``beam_size + 1`` likeliest next tokens; the candidates are ranked by their sum of
log-probabilities, those ending at end of text join the finished, and the best ``beam_size``
others are the next step's hypotheses. The search ends once ``beam_size * patience`` hypotheses
have finished, or at the window's length (engine/decode/search/base.py has what all searches share)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from engine.decode.request import Request
from engine.decode.search.base import Choice, Search
from engine.decode.step.output import Candidates, FirstRanks, Ranking


class BeamSearch(Search):
    def __init__(
        self, window: Request, prompt_block_ids: list[int], block_size: int, eot: int, n_text_ctx: int
    ):
        super().__init__(window, prompt_block_ids, block_size, eot, n_text_ctx)
        self.beam_size = window.options.beam_size
        self.max_finished = max(1, round(self.beam_size * (window.options.patience or 1.0)))

    def candidates_wanted(self, hypothesis: Request) -> int:
        return self.beam_size + 1

    def chooses_on_device(self) -> bool:
        # Every choice but the first (one hypothesis to beam_size: the prompt's blocks are shared
        # with the restart's hold), the last one by length included: the device's choice then
        # moves blocks nothing writes, which costs less than a step read before the next launches.
        return len(self.hypotheses) == self.beam_size

    def update(self, hypotheses: list[Request], offers: Candidates) -> bool:
        # Every offered sequence is distinct (the hypotheses are, and so are each one's candidates),
        # so a sequence is its parent and token. All of a step's candidates are ranked at once:
        # float32 sums (openai-whisper's), best first, equal sums in the order offered.
        self._texts_up_to_date()
        parent_of = self._parents_of(hypotheses)
        width = self.beam_size + 1
        logprobs = offers.logprobs[:, :width]
        sums_before = np.array([hypothesis.sum_logprob for hypothesis in hypotheses], dtype=np.float32)
        sums = sums_before[:, None] + logprobs
        order = np.argsort(-sums.ravel(), kind="stable").tolist()
        # Python numbers, read once: indexing numpy arrays element by element costs more.
        tokens = offers.tokens[:, :width].ravel().tolist()
        logprob_of, sum_of = logprobs.ravel().tolist(), sums.ravel().tolist()
        chosen = self._take(
            Choice(parent_of[flat // width], tokens[flat], logprob_of[flat], sum_of[flat]) for flat in order
        )
        at_length = self._continue_with(chosen)
        return len(self.finished) >= self.max_finished or at_length

    def follow_device_choice(
        self, ranks: FirstRanks, row: int, every_rank: Ranking | None, step_id: int
    ) -> bool:
        if every_rank is None:  # the usual step: the best k all go on, and nothing finishes
            at_length = self._follow_device_choice(ranks, row, step_id)
        else:
            self._texts_up_to_date()  # a text that ends now is its parent's, as chosen so far
            chosen = self._take(map(Choice._make, zip(*every_rank)))
            at_length = self._follow_device_choice(FirstRanks.of_choices(chosen), 0, step_id)
        return len(self.finished) >= self.max_finished or at_length

    def _take(self, ranked: Iterator[Choice]) -> list[Choice]:
        """From the sequences best first: the first ``beam_size`` that go on are chosen; those
        ending at end of text before them finish (up to ``max_finished``)."""
        eot = self.text_end
        chosen: list[Choice] = []
        newly_finished: list[Choice] = []
        for choice in ranked:
            if choice.token == eot:
                newly_finished.append(choice)
            else:
                chosen.append(choice)
                if len(chosen) == self.beam_size:
                    break
        for choice in newly_finished:
            if len(self.finished) >= self.max_finished:
                break
            self._finish_sequence(choice)
        return chosen

    def _unfinished_to_rank(self, finished: dict) -> list[Request]:
        # openai-whisper's finalize: the best live hypotheses fill up to beam_size candidates, best
        # first; among equal sums the later one first, as numpy's argsort reversed orders them.
        live = sorted(self.hypotheses, key=lambda hypothesis: hypothesis.sum_logprob)[::-1]
        return live[: max(0, self.beam_size - len(finished))]
