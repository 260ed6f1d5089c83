"""What reading a step gives the scheduler: each row's token and what came with it, by row of
the step's Batch (the scheduler keeps which request each row was)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Candidates:
    """What a step read back for hypotheses, one row each: the tokens each offers to go on with
    (its likeliest tokens best first, or its draws) and their log-probabilities. A hypothesis that
    offers fewer than ``width`` uses its row's first ones."""

    tokens: np.ndarray  # [rows, width] int64
    logprobs: np.ndarray  # [rows, width] float32

    def select(self, rows: list[int]) -> Candidates:
        """The rows ``rows`` (increasing); a view when they are consecutive (a search's hypotheses are)."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return Candidates(self.tokens[rows[0] : rows[-1] + 1], self.logprobs[rows[0] : rows[-1] + 1])
        return Candidates(self.tokens[rows], self.logprobs[rows])


class Ranking(NamedTuple):
    """A choice made on the device where a text may end, read back: its every candidate by rank,
    best first, each one's parent (the hypothesis it continues), token, log-probability and sum
    of log-probabilities (in the order of a search's ``Choice``)."""

    parent: list[int]
    token: list[int]
    logprob: list[float]
    sum_logprob: list[float]


class FirstRanks(NamedTuple):
    """The first ranks of the choices a step made on the device, read back as arrays, row i for
    its i-th search: where no text ends among a search's first ``beam_size`` ranks, those are its
    children (the usual step). Each child's parent, token, log-probability and sum. A search's
    trail keeps its row (the search follows the device's choice): nothing is converted to Python numbers
    until its texts are brought up to date."""

    parent: np.ndarray  # [searches, most beams] int64
    token: np.ndarray  # int64
    logprob: np.ndarray  # float32
    sum_logprob: np.ndarray  # float32

    @classmethod
    def of_choices(cls, chosen: list[tuple[int, int, float, float]]) -> FirstRanks:
        """One search's children chosen on the host from its every rank, as row 0."""
        parents, tokens, logprobs, sums = zip(*chosen)
        return cls(
            np.array([parents], dtype=np.int64),
            np.array([tokens], dtype=np.int64),
            np.array([logprobs], dtype=np.float32),
            np.array([sums], dtype=np.float32),
        )


@dataclass(frozen=True)
class DeviceRankings:
    """The rankings of the choices a step made on the device, read back, one per search in the
    order the step's Batch listed them (its ``choosing``, then its steady tail's)."""

    first_ranks: FirstRanks
    every_rank: dict[int, Ranking]  # by row: searches whose text may end among their first ranks
    # [searches] bool: a candidate's log-probability is NaN (its hypothesis's logits overflowed).
    overflowed: np.ndarray


@dataclass(frozen=True)
class StepOutput:
    """A step's results on the host, by row of its Batch: what the scheduler appends."""

    step_id: int
    tokens: list[int]  # sampled, or at a detect row the language token
    logprobs: list[float]
    sampled_rows: set[int]  # of the rows read token by token (``host_rows``), those that sampled
    no_speech_probs: dict[int, float]  # rows that fed <|startoftranscript|>
    languages: dict[int, str]  # rows whose language was detected
    # Rows appended token by token (None: every row); a search whose choice the step made on the
    # device is read as a whole, from its ranking (``device_rankings``).
    host_rows: list[int] | None = None
    nonfinite_rows: set[int] = field(default_factory=set)  # rows whose log-probability is NaN or infinite
    # What the hypotheses' rows offered: row ``candidate_index[row]`` of ``candidates``.
    candidates: Candidates | None = None
    candidate_index: dict[int, int] = field(default_factory=dict)
    # The rankings of the searches whose choice the step made on the device.
    device_rankings: DeviceRankings | None = None
