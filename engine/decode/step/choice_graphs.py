"""The device's beam choice (engine/decode/step/beam_choice.py) replayed from CUDA graphs.

A beam step's choice is three kernels: each hypothesis's candidates, the choice itself and the
block copies it asks for. A beam step is bound by the host, and launched one by one (with the
fields' upload) these cost the host much more than one graph replay of them does, and Triton's
launches cost it more than PyTorch's.

What makes a captured choice replayable for any searches of its shape:
* the key is the step's shape (``ChoiceShape``) and where its filtered logits are (address, rows,
  row stride): a step's logits are the decode step's graph's output for its batch size, filtered in
  place, so a few addresses recur, and a choice captured reading one replays whenever a step's
  logits are there again (copying them into a buffer of the choice's would cost as much as a pass
  of the kernel over them);
* the searches' packed fields live in a static device buffer, refilled each step by one
  host-to-device copy out of pinned host buffers used in turn, as the decode graphs' inputs are;
* everything else the kernels read or write (sums, next tokens, block tables, timestamp
  histories, the cache) is a tensor the engine keeps for its lifetime;
* the copy kernel's grid covers a block's every position, not the step's most written: positions
  a copy does not ask for are masked, so the grid is the same at every step.

A shape is captured the second time it is seen (the first runs eagerly, which compiles the
kernels), so a server whose batches keep changing shape only pays the eager launches. Captured
shapes, and shapes seen once, are kept up to ``max_graphs`` each, the least recently used dropped
beyond it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.decode.batch import SteadyRows
from engine.device import PinnedStaging
from engine.kernels.beam_choice import SEARCH_FIELDS, triton_choose_beams
from engine.kernels.top_candidates import triton_top_candidates
from engine.kv.storage import PagedKVStorage

# A captured choice's copies cover a block's every position before the last (see above).
_EVERY_POSITION = -1

# The choice's per-search columns that a steady tail fills per step (the others are made once).
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


class ChoiceShape(NamedTuple):
    """What a captured choice is captured for, besides where its logits are and their shape."""

    searches: int
    hypotheses: int
    reserved: int  # the searches' reserved blocks, all together
    most_beams: int
    most_reserved: int  # one search's most, rounded up to a power of two


@dataclass(frozen=True)
class ChoiceKernelArgs:
    """What both kernels read besides the step's candidates and fields: tensors the engine keeps."""

    sums: torch.Tensor
    next_tokens: torch.Tensor
    tables: torch.Tensor
    history: torch.Tensor
    timestamp_begin: int
    storage: PagedKVStorage


@dataclass(frozen=True)
class _CapturedChoice:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # static input: the searches' fields, each hypothesis's slot and row, reservations
    rankings: torch.Tensor  # static output [4, S, most]


class ChoiceGraphs:
    def __init__(self, args: ChoiceKernelArgs, num_slots: int, max_graphs: int = 32):
        self.args = args
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _CapturedChoice] = OrderedDict()
        # Shapes seen once and not captured yet, as an LRU of the same size: a server whose
        # shapes keep changing forgets the ones it does not meet again.
        self._seen_once: OrderedDict[tuple, None] = OrderedDict()
        # At most every slot a search and every slot a hypothesis, and every block reserved.
        largest = num_slots * (len(SEARCH_FIELDS) + 2) + args.storage.null_block
        self._staging = PinnedStaging((largest,), torch.long)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def choose(self, logits: torch.Tensor, packed: list[int], shape: ChoiceShape) -> torch.Tensor:
        """The choice of ``shape.searches`` searches from the step's filtered ``logits`` [rows,
        vocab] and their ``packed`` fields (``launch_choice``'s layout); returns the rankings [4, S,
        most] (a static buffer: valid until this shape's next choice)."""
        key = (shape, *logits.shape, logits.stride(0), logits.data_ptr())
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen_once:
                self._seen_once[key] = None
                if len(self._seen_once) > self.max_graphs:
                    self._seen_once.popitem(last=False)
                staged = self._stage(packed, torch.empty(len(packed), dtype=torch.long, device=logits.device))
                return launch_choice(self.args, logits, staged, shape, _EVERY_POSITION)
            del self._seen_once[key]
            captured = self._capture(key, logits, len(packed), shape)
        self._graphs.move_to_end(key)
        self._stage(packed, captured.packed)
        captured.graph.replay()
        return captured.rankings

    def _stage(self, packed: list[int], target: torch.Tensor) -> torch.Tensor:
        """Copy ``packed`` into ``target`` (on the device) through a pinned buffer, without waiting
        for the device unless that buffer's last copy is still queued."""
        self._staging.next_buffer()[: len(packed)] = packed
        self._staging.copy_to(target)
        return target

    def _capture(
        self, key: tuple, logits: torch.Tensor, num_packed: int, shape: ChoiceShape
    ) -> _CapturedChoice:
        static_packed = torch.zeros(num_packed, dtype=torch.long, device=logits.device)
        graph = torch.cuda.CUDAGraph()
        # A memory pool of its own (a graph's memory is not shared with another's); thread-local:
        # K/V loader threads may use the device meanwhile (engine/decode/kv_loader.py).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            rankings = launch_choice(self.args, logits, static_packed, shape, _EVERY_POSITION)
        captured = _CapturedChoice(graph, static_packed, rankings)
        self._graphs[key] = captured
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured


def launch_choice(
    args: ChoiceKernelArgs,
    logits: torch.Tensor,
    packed: torch.Tensor,
    shape: ChoiceShape,
    most_written: int,
) -> torch.Tensor:
    """The choice's three kernels: ``packed`` (on the device) holds the searches' fields (columns
    SEARCH_FIELDS), then each hypothesis's slot, then its row of the filtered ``logits``, then the
    searches' reserved blocks; the copies move up to ``most_written`` positions (``_EVERY_POSITION``: a
    block's every position but its last). Returns the rankings [4, S, most]."""
    num_fields = shape.searches * len(SEARCH_FIELDS)
    hypotheses = packed[num_fields : num_fields + 2 * shape.hypotheses].view(2, -1)  # slot, row
    candidates = triton_top_candidates(logits, hypotheses[1], shape.most_beams + 1)
    rankings, copies = triton_choose_beams(
        candidates,
        packed[:num_fields].view(shape.searches, len(SEARCH_FIELDS)),
        hypotheses[0],
        packed[num_fields + 2 * shape.hypotheses :],
        args.sums,
        args.next_tokens,
        args.tables,
        args.history,
        args.timestamp_begin,
        shape.most_beams,
        shape.most_reserved,
    )
    most = args.storage.block_size - 1 if most_written == _EVERY_POSITION else most_written
    args.storage.copy_blocks_on_device(copies[0], copies[1], copies[2], most)
    return rankings


def steady_choice_fields(
    steady: SteadyRows, block_size: int, first_hypothesis: int, first_reserved: int
) -> np.ndarray:
    """A steady tail's searches' packed fields [searches, len(SEARCH_FIELDS)] for this step, after
    ``first_hypothesis`` hypotheses and ``first_reserved`` reserved blocks of other searches."""
    tail = steady.tail
    fields = tail.choice_fields.copy()
    if first_hypothesis:
        fields[:, _FIRST_HYPOTHESIS] += first_hypothesis
        fields[:, _FIRST_CANDIDATE] += first_hypothesis
    if first_reserved:
        fields[:, _FIRST_RESERVED] += first_reserved
    fields[:, _FIRST_ROW] = tail.first_hypotheses + steady.first_row
    fields[:, _BLOCK_INDEX] = steady.positions // block_size
    fields[:, _OFFSET] = steady.positions % block_size
    return fields


def steady_logit_rows(steady: SteadyRows) -> np.ndarray:
    """Each steady tail row's row of the step's sampled (filtered) logits."""
    return np.arange(steady.first_logit_row, steady.first_logit_row + steady.tail.num_rows)
