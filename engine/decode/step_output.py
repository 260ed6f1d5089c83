"""What reading a step gives the scheduler: each row's token and what came with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.decode.request import Request
from engine.decode.search import Candidates, FirstRanks, Ranking, Search


@dataclass(frozen=True)
class DeviceRankings:
    """The rankings of the choices a step made on the device, read back."""

    searches: list[Search]  # in the rankings' order
    first_ranks: FirstRanks
    every_rank: dict[int, Ranking]  # by row: searches whose text may end among their first ranks
    # [searches] bool: a candidate's log-probability is NaN (its hypothesis's logits overflowed).
    overflowed: np.ndarray


@dataclass(frozen=True)
class StepOutput:
    """A step's results on the host, by row of ``batch``: what the scheduler appends."""

    step_id: int
    batch: list[Request]
    epochs: list[int]
    tokens: list[int]  # sampled, or at a detect row the language token
    logprobs: list[float]
    sampled_rows: set[int]  # of the rows read token by token (``host_rows``), those that sampled
    no_speech_probs: dict[int, float]  # rows that fed <|startoftranscript|>
    languages: dict[int, str]  # rows whose language was detected
    computed_after: list[int]
    # Rows appended token by token (None: every row); a search whose choice the step made on the
    # device is read as a whole, from its ranking (``device_rankings``).
    host_rows: list[int] | None = None
    nonfinite_rows: set[int] = field(default_factory=set)  # rows whose log-probability is NaN or infinite
    # What the hypotheses' rows offered: row ``candidate_index[row]`` of ``candidates``.
    candidates: Candidates | None = None
    candidate_index: dict[int, int] = field(default_factory=dict)
    # The searches whose choice the step made on the device, and its rankings of their candidates.
    device_rankings: DeviceRankings | None = None
