"""Best of n samples at a temperature above 0, as openai-whisper decodes with ``best_of``: the
prompt runs once and its first token is drawn n times, each draw a hypothesis that then samples
on its own until end of text; the search ends when every sample has ended (or at the window's
length), and the best by the same ranking as beam search is the window's text."""

from __future__ import annotations

import numpy as np
import torch

from engine.decode.prompt import FALLBACK_SEED
from engine.decode.request import Request
from engine.decode.search.base import Choice, Search
from engine.decode.step.output import Candidates


class BestOfSamples(Search):
    def __init__(
        self, window: Request, prompt_block_ids: list[int], block_size: int, eot: int, n_text_ctx: int
    ):
        super().__init__(window, prompt_block_ids, block_size, eot, n_text_ctx)
        self.samples = window.options.best_of
        seed = window.options.seed if window.options.seed is not None else FALLBACK_SEED
        device = window.generator.device if window.generator is not None else torch.device("cpu")
        # One generator per sample, so samples are independent and a window's draws repeat run to run.
        self.generators = [
            torch.Generator(device=device).manual_seed(seed * 7919 + window.attempt * 101 + index)
            for index in range(self.samples)
        ]
        self.hypotheses[0].sample_with(self.generators[0])

    def candidates_wanted(self, hypothesis: Request) -> int:
        # The prompt's first token is drawn once per sample; afterwards each sample draws its own.
        return self.samples if not hypothesis.output_tokens and len(self.hypotheses) == 1 else 1

    def update(self, hypotheses: list[Request], offers: Candidates) -> bool:
        eot = self.text_end
        parent_of = self._parents_of(hypotheses)
        wanted = self.candidates_wanted(hypotheses[0])  # as at launch: nothing has changed since
        logprobs = offers.logprobs[:, :wanted]
        sums_before = np.array([hypothesis.sum_logprob for hypothesis in hypotheses], dtype=np.float32)
        # float32 sums, as openai-whisper keeps them: the same rounding keeps near-ties alike.
        sums = (sums_before[:, None] + logprobs).tolist()
        chosen: list[Choice] = []
        for row, parent in enumerate(parent_of):
            draws = zip(offers.tokens[row, :wanted].tolist(), logprobs[row].tolist(), sums[row])
            for token, logprob, sum_logprob in draws:
                choice = Choice(parent, token, logprob, sum_logprob)
                if token == eot:
                    self._finish_sequence(choice)
                else:
                    chosen.append(choice)
        at_length = self._continue_with(chosen)
        for hypothesis, generator in zip(self.hypotheses, self.generators):
            hypothesis.sample_with(generator)  # the samples that go on keep drawing independently
        return not chosen or at_length

    def _unfinished_to_rank(self, finished: dict) -> list[Request]:
        return list(self.hypotheses)  # at the window's length every sample counts, unended
