"""The rows of the beam searches whose choices the device makes, as one tail of a step's batch.

Once the device makes a search's choices (engine/decode/beam_on_device.py) it makes every later
one, and from step to step its k hypotheses do the same thing: each feeds the token the device
chose for it, from its row of the step before, at the search's one position, and samples; the
device keeps their block tables. In their rows' columns (StepInput's, RowsToSample's, the
choice's packed fields) only the position and the rows moved between steps change. At many beams
the host's work per row is what bounds a step (issue 21), so the pipeline puts these searches'
rows at the end of the batch, in the scheduler's order, and makes their columns once, when the
set of such searches changes: a step extends its columns with them and works out the positions
and rows with a few array operations, not a pass over the rows.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.decode.request import FROM_LAST_STEP, Request
from engine.decode.search import Search
from engine.kernels.beam_choice import SEARCH_FIELDS

if TYPE_CHECKING:
    from engine.kv.block_tables import DeviceBlockTables

# A tail row's fed tokens when its token is still on the device (shared, never changed).
_FED_FROM_LAST_STEP = [FROM_LAST_STEP]
# The choice's per-search columns that are the same at every step (the others are filled per step).
_FIRST_HYPOTHESIS, _FIRST_CANDIDATE, _FIRST_ROW, _BLOCK_INDEX, _OFFSET, _FIRST_RESERVED = (
    SEARCH_FIELDS.index(name)
    for name in (
        "first_hypothesis",
        "first_candidate",
        "first_row",
        "block_index",
        "offset",
        "first_reserved",
    )
)


@functools.cache
def cross_readers_of(hypotheses: int, limit: int) -> tuple[int, ...]:
    """A search's rows' cross-attention readers (StepInput.cross_readers): each run of up to
    ``limit`` rows is read once, counted by its first row."""
    return tuple(min(limit, hypotheses - index) if index % limit == 0 else 0 for index in range(hypotheses))


@dataclass(frozen=True)
class SteadyTail:
    """Steady searches' columns, made once for a set of searches in one order."""

    searches: list[Search]
    hypotheses: list[Request]  # every search's, in order: the tail's rows
    # Each search's first hypothesis, which stands for all of them (engine/decode/search.py).
    leaders: list[Request]
    beam_sizes: np.ndarray  # [searches] int64
    text_ends: np.ndarray  # [searches] int64: each search's token that ends a text (-1: none)
    first_hypotheses: np.ndarray  # [searches] int64: each search's first row in the tail
    within: np.ndarray  # [rows] int64: each row's index in its search
    # StepInput's and RowsToSample's columns that do not change while the searches are steady.
    slots: list[int]
    fed: list[list[int]]
    no_sot: list[int]
    epochs: list[int]
    cross_readers: list[int]
    not_first: list[bool]
    timestamps: list[bool]
    temperatures: list[float]
    # The choice's packed fields (engine/decode/choice_graphs.py's layout), as the tail's own: the
    # per-search columns [searches, len(SEARCH_FIELDS)] with those filled per step left at 0, the
    # slots, and the reserved blocks.
    choice_fields: np.ndarray
    choice_slots: np.ndarray
    reserved: np.ndarray
    most_reserved: int  # one search's most reserved blocks

    @classmethod
    def of(cls, searches: list[Search], tables: DeviceBlockTables, cross_reader_limit: int) -> SteadyTail:
        hypotheses = [hypothesis for search in searches for hypothesis in search.hypotheses]
        beam_sizes = np.array([len(search.hypotheses) for search in searches], dtype=np.int64)
        first_hypotheses = np.concatenate([[0], np.cumsum(beam_sizes)[:-1]]).astype(np.int64)
        reservations = [search.launch_device_choice() for search in searches]
        first_reserved = np.concatenate([[0], np.cumsum([len(r) for r in reservations])[:-1]])
        text_ends = np.array([search.text_end for search in searches], dtype=np.int64)
        fields = np.zeros((len(searches), len(SEARCH_FIELDS)), dtype=np.int64)
        fields[:, SEARCH_FIELDS.index("beam_size")] = beam_sizes
        fields[:, _FIRST_HYPOTHESIS] = first_hypotheses
        fields[:, _FIRST_CANDIDATE] = first_hypotheses  # the candidates are the hypotheses', in order
        fields[:, SEARCH_FIELDS.index("eot")] = text_ends
        fields[:, _FIRST_RESERVED] = first_reserved
        fields[:, SEARCH_FIELDS.index("num_reserved")] = [len(r) for r in reservations]
        slots = [tables.slot_of(hypothesis.request_id, hypothesis.blocks) for hypothesis in hypotheses]
        count = len(hypotheses)
        return cls(
            searches=searches,
            hypotheses=hypotheses,
            leaders=[search.hypotheses[0] for search in searches],
            beam_sizes=beam_sizes,
            text_ends=text_ends,
            first_hypotheses=first_hypotheses,
            within=np.arange(count, dtype=np.int64) - np.repeat(first_hypotheses, beam_sizes),
            slots=slots,
            fed=[_FED_FROM_LAST_STEP] * count,
            no_sot=[-1] * count,
            epochs=[hypothesis.epoch for hypothesis in hypotheses],
            cross_readers=list(
                itertools.chain.from_iterable(
                    cross_readers_of(len(search.hypotheses), cross_reader_limit) for search in searches
                )
            ),
            not_first=[False] * count,
            timestamps=[search.window.options.timestamps for search in searches for _ in search.hypotheses],
            temperatures=[0.0] * count,
            choice_fields=fields,
            choice_slots=np.array(slots, dtype=np.int64),
            reserved=np.array(list(itertools.chain.from_iterable(reservations)), dtype=np.int64),
            most_reserved=max(map(len, reservations)),
        )

    def same_searches(self, searches: list[Search]) -> bool:
        """Whether the tail is made for ``searches``, in that order (a steady search keeps its k
        hypotheses to its end, so the searches decide the rest)."""
        return len(searches) == len(self.searches) and all(map(operator.is_, searches, self.searches))


@dataclass(frozen=True)
class SteadyRows:
    """Where a step put a tail's rows, and the searches' positions then: what the device's choice
    needs of them."""

    tail: SteadyTail
    first_row: int  # of the step's rows
    first_logit_row: int  # of the step's sampled rows
    positions: np.ndarray  # [searches] int64: where each search's children write next

    def choice_fields(self, block_size: int, first_hypothesis: int, first_reserved: int) -> np.ndarray:
        """The searches' packed fields [searches, len(SEARCH_FIELDS)] for this step, after
        ``first_hypothesis`` hypotheses and ``first_reserved`` reserved blocks of other searches."""
        tail = self.tail
        fields = tail.choice_fields.copy()
        if first_hypothesis:
            fields[:, _FIRST_HYPOTHESIS] += first_hypothesis
            fields[:, _FIRST_CANDIDATE] += first_hypothesis
        if first_reserved:
            fields[:, _FIRST_RESERVED] += first_reserved
        fields[:, _FIRST_ROW] = tail.first_hypotheses + self.first_row
        fields[:, _BLOCK_INDEX] = self.positions // block_size
        fields[:, _OFFSET] = self.positions % block_size
        return fields

    def logit_rows(self) -> np.ndarray:
        """Each tail row's row of the step's sampled (filtered) logits."""
        return np.arange(self.first_logit_row, self.first_logit_row + len(self.tail.hypotheses))
