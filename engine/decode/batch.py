"""What crosses from the scheduler to the step side: one step's rows, as columns of ids, tokens,
positions and sampling settings; never a Request.

The scheduler (engine/decode/scheduler/) makes a ``Batch`` in one pass over the requests that step,
and moves each of them on to after the step as it goes; the step side (engine/decode/step/) launches
it and reads it back as a StepOutput, which the scheduler applies. Columns, not an object per row:
at many rows the host's work per row is what bounds a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A fed token the host does not know yet: the device reads it from the last launched step.
FROM_LAST_STEP = -1


@dataclass(frozen=True)
class StepInput:
    """What the runner needs of a step's rows, as columns: a step has one row per running
    sequence, every hypothesis of every beam search included, and the columns are filled in one
    pass and read as they are (no object per row)."""

    slots: list[int]  # each row's block-table row
    tokens: list[list[int]]  # fed this step; the first may be FROM_LAST_STEP
    sources: list[int]  # the row of the last launched step whose token a FROM_LAST_STEP means, or -1
    starts: list[int]  # position of the first fed token
    sot_offsets: list[int]  # index of <|startoftranscript|> in the row's tokens, or -1 when not fed
    # Per row, the rows from it on that read its cross-attention K/V (a window's beams, adjacent
    # rows), 0 for a row counted by an earlier one; None: each row reads its own.
    cross_readers: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @property
    def max_fed(self) -> int:
        return max(map(len, self.tokens))


@dataclass
class RowsToSample:
    """The rows of a step that sample, as columns: a beam search's hypotheses add theirs a search
    at a time."""

    rows: list[int] = field(default_factory=list)  # of the step
    # Each row's own generator (a temperature above 0 draws from it), or None.
    generators: list[torch.Generator | None] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)  # its first sampled token (the rules suppress more)
    timestamps: list[bool] = field(default_factory=list)
    # A hypothesis's is 0 here: it draws its candidates below, not a token.
    temperatures: list[float] = field(default_factory=list)
    hypotheses: list[int] = field(default_factory=list)  # indexes (into ``rows``) of hypotheses' rows
    offering: list[int] = field(default_factory=list)  # of those, the ones offering the host candidates
    # Per offering row: how many candidates it offers, at which temperature, drawn from which generator.
    offering_wanted: list[int] = field(default_factory=list)
    offering_temperatures: list[float] = field(default_factory=list)
    offering_generators: list[torch.Generator | None] = field(default_factory=list)
    # Of the hypotheses' rows, the ones whose timestamp history is to follow the text the host chose
    # for them, and those texts.
    restore_history: list[int] = field(default_factory=list)
    restore_texts: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class SearchRows:
    """A search whose choice a launched step makes on the device, and where its hypotheses are."""

    rows: range  # its hypotheses' rows in the step, in the search's order
    logit_rows: range  # their rows of the step's sampled (filtered) logits
    slots: list[int]  # their block-table slots
    position: int  # where the children write next
    sums: list[float]  # its hypotheses' sums of log-probabilities, as the host chose them
    text_end: int  # the token that ends a text, or -1
    reserved: list[int]  # the blocks the device may hand out as spares


@dataclass(frozen=True)
class SteadyColumns:
    """The rows of the beam searches whose choices the device makes (a steady tail of the batch),
    made once for a set of searches in one order: only positions and rows change between steps."""

    beam_sizes: np.ndarray  # [searches] int64
    text_ends: np.ndarray  # [searches] int64: each search's token that ends a text (-1: none)
    first_hypotheses: np.ndarray  # [searches] int64: each search's first row in the tail
    within: np.ndarray  # [rows] int64: each row's index in its search
    # StepInput's and RowsToSample's columns that do not change while the searches are steady.
    slots: list[int]
    fed: list[list[int]]
    no_sot: list[int]
    cross_readers: list[int]
    not_first: list[bool]
    timestamps: list[bool]
    temperatures: list[float]
    generators: list[torch.Generator | None]
    # The choice's packed fields (engine/decode/step/choice_graphs.py's layout): the per-search
    # columns [searches, len(SEARCH_FIELDS)] with those filled per step left at 0, the slots, and
    # the reserved blocks (all together, and each search's).
    choice_fields: np.ndarray
    choice_slots: np.ndarray
    reserved: np.ndarray
    reservations: list[list[int]]
    most_reserved: int  # one search's most reserved blocks

    @property
    def num_rows(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class SteadyRows:
    """Where a step put a steady tail's rows, and the searches' positions then: what the device's
    choice needs of them."""

    tail: SteadyColumns
    first_row: int  # of the step's rows
    first_logit_row: int  # of the step's sampled rows
    positions: np.ndarray  # [searches] int64: where each search's children write next


@dataclass
class Batch:
    """One step's rows, and what launching it needs besides the runner's input."""

    step_id: int | None  # None: rows described only (what the benchmarks replay), nothing launched
    input: StepInput
    table_rewrites: dict[int, list[int]]  # slot -> its self-attention blocks, changed since written
    sot_rows: list[int] = field(default_factory=list)  # rows that feed <|startoftranscript|>
    detect_rows: list[int] = field(default_factory=list)  # of those, rows whose language is detected
    # Per detect row, the languages it may be detected as (its request's ``languages``); None: any.
    detect_languages: list[tuple[str, ...] | None] = field(default_factory=list)
    host_rows: list[int] = field(default_factory=list)  # rows read token by token
    to_sample: RowsToSample = field(default_factory=RowsToSample)
    choosing: list[SearchRows] = field(default_factory=list)  # searches before the tail, chosen on the device
    steady: SteadyRows | None = None

    def __len__(self) -> int:
        return self.input.num_rows
