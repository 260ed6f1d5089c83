"""The rows of the beam searches whose choices the device makes, as one tail of a step's batch.

Once the device makes a search's choices (engine/decode/step/beam_choice.py) it makes every later
one, and from step to step its k hypotheses do the same thing: each feeds the token the device
chose for it, from its row of the step before, at the search's one position, and samples; the
device keeps their block tables. In their rows' columns (StepInput's, RowsToSample's, the
choice's packed fields) only the position and the rows moved between steps change. At many beams
the host's work per row is what bounds a step, so the scheduler puts these searches' rows at the
end of the batch, in its order, and makes their columns (engine/decode/batch.py's SteadyColumns)
once, when the set of such searches changes: a step extends its columns with them and works out
the positions and rows with a few array operations, not a pass over the rows.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np

from engine.decode.batch import FROM_LAST_STEP, SteadyColumns
from engine.decode.request import Request
from engine.decode.search.base import Search
from engine.kernels.beam_choice import SEARCH_FIELDS
from engine.kv.block_tables import DeviceBlockTables

# A tail row's fed tokens when its token is still on the device (shared, never changed).
_FED_FROM_LAST_STEP = [FROM_LAST_STEP]


@functools.cache
def cross_readers_of(hypotheses: int, limit: int) -> tuple[int, ...]:
    """A search's rows' cross-attention readers (StepInput.cross_readers): each run of up to
    ``limit`` rows is read once, counted by its first row."""
    return tuple(min(limit, hypotheses - index) if index % limit == 0 else 0 for index in range(hypotheses))


@dataclass(frozen=True)
class SteadyTail:
    """Steady searches, and their columns made once for them in one order."""

    searches: list[Search]
    hypotheses: list[Request]  # every search's, in order: the tail's rows
    # Each search's first hypothesis, which stands for all of them (engine/decode/search/base.py).
    leaders: list[Request]
    epochs: list[int]
    columns: SteadyColumns

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
        fields[:, SEARCH_FIELDS.index("first_hypothesis")] = first_hypotheses
        # The candidates are the hypotheses', in order.
        fields[:, SEARCH_FIELDS.index("first_candidate")] = first_hypotheses
        fields[:, SEARCH_FIELDS.index("eot")] = text_ends
        fields[:, SEARCH_FIELDS.index("first_reserved")] = first_reserved
        fields[:, SEARCH_FIELDS.index("num_reserved")] = [len(r) for r in reservations]
        slots = [tables.slot_of(hypothesis.request_id, hypothesis.blocks) for hypothesis in hypotheses]
        count = len(hypotheses)
        columns = SteadyColumns(
            beam_sizes=beam_sizes,
            text_ends=text_ends,
            first_hypotheses=first_hypotheses,
            within=np.arange(count, dtype=np.int64) - np.repeat(first_hypotheses, beam_sizes),
            slots=slots,
            fed=[_FED_FROM_LAST_STEP] * count,
            no_sot=[-1] * count,
            cross_readers=list(
                itertools.chain.from_iterable(
                    cross_readers_of(len(search.hypotheses), cross_reader_limit) for search in searches
                )
            ),
            not_first=[False] * count,
            timestamps=[search.window.options.timestamps for search in searches for _ in search.hypotheses],
            temperatures=[0.0] * count,
            generators=[hypothesis.generator for hypothesis in hypotheses],
            choice_fields=fields,
            choice_slots=np.array(slots, dtype=np.int64),
            reserved=np.array(list(itertools.chain.from_iterable(reservations)), dtype=np.int64),
            reservations=reservations,
            most_reserved=max(map(len, reservations)),
        )
        return cls(
            searches=searches,
            hypotheses=hypotheses,
            leaders=[search.hypotheses[0] for search in searches],
            epochs=[hypothesis.epoch for hypothesis in hypotheses],
            columns=columns,
        )

    def same_searches(self, searches: list[Search]) -> bool:
        """Whether the tail is made for ``searches``, in that order (a steady search keeps its k
        hypotheses to its end, so the searches decide the rest)."""
        return len(searches) == len(self.searches) and all(map(operator.is_, searches, self.searches))
