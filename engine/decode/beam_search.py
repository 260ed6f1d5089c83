"""Beam search at temperature 0, as openai-whisper's BeamSearchDecoder: each live hypothesis offers
its ``beam_size + 1`` likeliest next tokens; the candidates are ranked by their sum of
log-probabilities, those ending at end of text join the finished, and the best ``beam_size``
others are the next step's hypotheses. The search ends once ``beam_size * patience`` hypotheses
have finished, or at the window's length (engine/decode/search.py has what all searches share)."""

from __future__ import annotations

from engine.decode.request import Request
from engine.decode.search import Candidates, Choice, Search, f32_sum


class BeamSearch(Search):
    def __init__(
        self, window: Request, prompt_block_ids: list[int], block_size: int, eot: int, n_text_ctx: int
    ):
        super().__init__(window, prompt_block_ids, block_size, eot, n_text_ctx)
        self.beam_size = window.options.beam_size
        self.max_finished = max(1, round(self.beam_size * (window.options.patience or 1.0)))

    def candidates_wanted(self, hypothesis: Request) -> int:
        return self.beam_size + 1

    def update(self, candidates: list[tuple[Request, Candidates]]) -> bool:
        ignore_eot = self.window.options.ignore_eot
        index_of = self._index_of()
        offered: dict[tuple[int, ...], Choice] = {}
        for hypothesis, tokens in candidates:
            for token, logprob in zip(tokens.tokens, tokens.logprobs):
                sequence = (*hypothesis.output_tokens, token)
                offered[sequence] = Choice(
                    sequence, index_of[id(hypothesis)], logprob, f32_sum(hypothesis.sum_logprob, logprob)
                )
        chosen: list[Choice] = []
        newly_finished: list[Choice] = []
        for choice in sorted(offered.values(), key=lambda choice: choice.sum_logprob, reverse=True):
            if choice.tokens[-1] == self.eot and not ignore_eot:
                newly_finished.append(choice)
            else:
                chosen.append(choice)
                if len(chosen) == self.beam_size:
                    break
        parents = self._snapshots()
        for choice in newly_finished:
            if len(self.finished) >= self.max_finished:
                break
            self._finish_sequence(choice, parents)
        at_length = self._continue_with(chosen, parents)
        return len(self.finished) >= self.max_finished or at_length

    def _unfinished_to_rank(self, finished: dict) -> list[Request]:
        # openai-whisper's finalize: the best live hypotheses fill up to beam_size candidates, best
        # first; among equal sums the later one first, as numpy's argsort reversed orders them.
        live = sorted(self.hypotheses, key=lambda hypothesis: hypothesis.sum_logprob)[::-1]
        return live[: max(0, self.beam_size - len(finished))]
