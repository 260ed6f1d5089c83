"""The decode step captured as CUDA graphs, at a ladder of batch sizes.

A decode step launches ~20 small kernels per decoder layer; at large-v3-turbo's 4 layers and at
large batches the GPU finishes them faster than Python can launch them, so the step is captured
once per batch size and replayed. What makes a captured step replayable for any requests:

* inputs live in one static device buffer, refilled by a single host-to-device copy per step
  (a token sampled by the step before, not read on the host yet, is taken from the runner's
  ``next_tokens`` inside the graph);
* block tables are gathered on the device from fixed rows (engine.kv.block_tables);
* cross-attention is sized for a full window's 1500 frames, each row reading its own window's
  length (fewer for a window encoded over only its audio) from the block tables by slot, and the
  self-attention grid is sized for the whole 448-token text context, so kernel grids never depend
  on the batch.
  Small batches also get a second graph per size, sized for texts of at most ``SHORT_TEXT_KEYS``
  tokens: its self-attention reads them in one program per head group, with no split and no
  combining kernel. A step whose texts are all that short (a short clip's whole decode, the start of
  every window) replays it; sized for 448 tokens, the same step spends its time on splits past the
  text's end and on the kernel that combines them;
* a window's beams read its cross-attention K/V once (StepInput.cross_readers, an input row like
  the others: 1 for a row that reads alone), where the attention backend can;
* a batch is padded up to the next captured size with rows that write only the null block.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from engine.decode.batch import StepInput
from engine.decode.step.runner import ModelRunner, StepTensors
from engine.device import PinnedStaging

# Rows of the static input buffer.
_TOKEN, _SOURCE, _POSITION, _SLOT, _SELF_LEN, _CROSS_READERS = range(6)
_ROWS = _CROSS_READERS + 1
# Texts of at most this many tokens (the prompt's and the sampled ones) have graphs of their own at
# batch sizes up to SHORT_TEXT_MAX_BATCH: one attention split holds them (the Triton backend's
# min_keys_per_split). At larger batches the step is no faster with them.
SHORT_TEXT_KEYS = 64
SHORT_TEXT_MAX_BATCH = 8


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to (and including) max_batch_size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch_size: int):
        self.runner = runner
        self.sizes = capture_sizes(max_batch_size)
        largest = self.sizes[-1]
        device = runner.device
        self._staging = PinnedStaging((_ROWS, largest), torch.int32)
        self._inputs = torch.zeros((_ROWS, largest), dtype=torch.int32, device=device)
        self._token_rows = torch.arange(largest, device=device)
        self._query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._padding = np.array([0, -1, 0, runner.tables.pad_slot, 1, 1], dtype=np.int32)[:, None]
        # By (batch size, the text length the self-attention is sized for).
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # steps replayed, by graph
        self._capture()

    def _keys(self) -> list[tuple[int, int]]:
        """Every graph to capture: (batch size, the text length its self-attention is sized for)."""
        context = self.runner.model.dims.n_text_ctx
        keys = [(size, context) for size in self.sizes]
        if SHORT_TEXT_KEYS < context:
            keys += [(size, SHORT_TEXT_KEYS) for size in self.sizes if size <= SHORT_TEXT_MAX_BATCH]
        return keys

    def _step(self, size: int, text_keys: int) -> StepTensors:
        inputs = self._inputs
        return StepTensors(
            token_ids=inputs[_TOKEN, :size].long(),
            token_sources=inputs[_SOURCE, :size].long(),
            positions=inputs[_POSITION, :size].long(),
            token_rows=self._token_rows[:size],
            slots=inputs[_SLOT, :size].long(),
            query_start_loc=self._query_start[: size + 1],
            self_lens=inputs[_SELF_LEN, :size],
            max_query_len=1,
            max_self_len=text_keys,
            cross_readers=inputs[_CROSS_READERS, :size] if self.runner.max_cross_readers > 1 else None,
        )

    def _capture(self) -> None:
        self._graphs.clear()
        self._logits.clear()
        self._staging.next_buffer()[:] = self._padding
        self._staging.copy_to(self._inputs)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then reuse the memory pool the largest one reserved.
        for key in sorted(self._keys(), reverse=True):
            self.runner.forward(self._step(*key), None)  # warm-up, so Triton compiles outside the capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[key] = self.runner.forward(self._step(*key), None)
            self._graphs[key] = graph
        torch.cuda.synchronize(self.runner.device)

    def fits(self, step: StepInput) -> bool:
        """A step of a captured size that feeds one token per request (sampled, or a prompt's)."""
        return step.num_rows <= self.sizes[-1] and step.max_fed == 1

    def replay(self, step: StepInput) -> torch.Tensor:
        """Run the step; returns float32 logits [step.num_rows, vocab] (a view, valid until the next
        replay)."""
        count = step.num_rows
        size = next(s for s in self.sizes if s >= count)
        host = self._staging.next_buffer()
        positions = np.array(step.starts, dtype=np.int32)
        key = (size, SHORT_TEXT_KEYS)
        if key not in self._graphs or positions.max() >= SHORT_TEXT_KEYS:
            key = (size, self.runner.model.dims.n_text_ctx)
        host[_TOKEN, :count] = [fed[0] for fed in step.tokens]
        host[_SOURCE, :count] = step.sources
        host[_POSITION, :count] = positions
        host[_SLOT, :count] = step.slots
        host[_SELF_LEN, :count] = positions + 1
        host[_CROSS_READERS, :count] = 1 if step.cross_readers is None else step.cross_readers
        host[:, count:size] = self._padding
        self._staging.copy_to(self._inputs)
        self._graphs[key].replay()
        self.replays[key] += 1
        return self._logits[key][:count]
