"""Cross-attention on a CPU that reads each request's K/V where it lies in the blocks.

The torch reference gathers a decode batch's cross-attention K/V (1500 positions per request, in
every layer, at every step) into one padded tensor before attending: a copy as large as the reads
that follow it. Here a request's blocks are attended in place. A run of consecutive block ids is
one strided view [blocks, block_size, H * D] of the block-major cache (the pool hands a window
its cross blocks as one run where it can: engine/kv/block_pool.py), and a few matrix products
over that view attend a group of G heads at once: the queries are laid out block-diagonally,
[G x n_q, G * D] with query (h, i) nonzero only in head h's columns, so one product gives each
head's scores against every key. The off-diagonal products are wasted work (G times the useful
multiply-adds), cheaper than a product per head up to about six heads a product. A table of several
runs is attended run by run, the scores of all its runs softmaxed together. Requests that share a
table (a window's beams) are attended together.

Self-attention (causal, a few blocks) and an fp8 cache keep the reference's gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.arith import ceil_div
from engine.attention.base import PagedAttentionBatch
from engine.attention.torch_ref import TorchReferenceBackend
from engine.kv.block_pool import block_runs


@dataclass
class _KeyGroup:
    """Requests that read one block table (a window's beams share theirs) and what they read."""

    query_rows: list[int]  # rows of the packed query tensor, in order
    runs: list[tuple[int, int]]  # (first block id, number of blocks): consecutive ids, in table order
    seq_len: int


class CpuInPlaceBackend(TorchReferenceBackend):
    """The torch reference, with cross-attention read in place on a CPU."""

    name = "torch"
    prefers_consecutive_blocks = True

    def __init__(self) -> None:
        super().__init__()
        # Every layer of a step reads the same batch: its groups are worked out once per step.
        self._planned: tuple[PagedAttentionBatch, list[_KeyGroup]] | None = None

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedAttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        if batch.causal or query.device.type != "cpu" or key_cache.dtype != query.dtype:
            return super().paged_attention(query, key_cache, value_cache, batch, scale)
        out = torch.empty_like(query)
        for group in self._groups(batch, key_cache.shape[1]):
            self._attend_group(query, key_cache, value_cache, group, scale, out)
        return out

    def _groups(self, batch: PagedAttentionBatch, block_size: int) -> list[_KeyGroup]:
        if self._planned is not None and self._planned[0] is batch:
            return self._planned[1]
        starts = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        tables = batch.block_tables.tolist()
        by_table: dict[tuple, _KeyGroup] = {}
        for request, seq_len in enumerate(seq_lens):
            table = tuple(tables[request][: ceil_div(seq_len, block_size)])
            rows = list(range(starts[request], starts[request + 1]))
            group = by_table.get((table, seq_len))
            if group is None:
                by_table[(table, seq_len)] = _KeyGroup(rows, block_runs(list(table)), seq_len)
            else:
                group.query_rows.extend(rows)
        groups = list(by_table.values())
        self._planned = (batch, groups)
        return groups

    @staticmethod
    def _attend_group(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: _KeyGroup,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_size = key_cache.shape[1]
        rows = group.query_rows
        contiguous_rows = rows == list(range(rows[0], rows[-1] + 1))
        queries = query[rows[0] : rows[-1] + 1] if contiguous_rows else query[rows]
        num_queries = queries.shape[0]
        heads = heads_per_product(num_heads)
        attended_heads = []
        for first_head in range(0, num_heads, heads):
            columns = slice(first_head * head_dim, (first_head + heads) * head_dim)
            runs = [
                (
                    key_cache[first : first + count].flatten(2)[..., columns],
                    value_cache[first : first + count].flatten(2)[..., columns],
                )
                for first, count in group.runs
            ]
            # [G, n_q, G, D]: query i of head h in head h's columns, zeros elsewhere.
            block_diagonal = query.new_zeros(heads, num_queries, heads, head_dim)
            own_queries = queries[:, first_head : first_head + heads].permute(0, 2, 1)
            block_diagonal.diagonal(dim1=0, dim2=2).copy_(own_queries * scale)
            columns_t = block_diagonal.view(heads * num_queries, heads * head_dim).t()
            # Keys x queries (not queries x keys: measured faster): [blocks, block_size, G x n_q],
            # then one row per (head, query) over the whole sequence.
            scores = torch.cat([torch.bmm(keys, columns_t.expand(len(keys), -1, -1)) for keys, _ in runs])
            scores = scores.permute(2, 0, 1).reshape(heads * num_queries, -1)
            scores[:, group.seq_len :] = float("-inf")  # the last block's unwritten slots
            probabilities = torch.softmax(scores, dim=-1).view(len(scores), -1, block_size)
            attended = None
            first_block = 0
            for _, values in runs:
                count = values.shape[0]
                weights = probabilities[:, first_block : first_block + count].transpose(0, 1)
                partial = torch.bmm(weights, values).sum(0)  # [G x n_q, G * D]
                attended = partial if attended is None else attended + partial
                first_block += count
            # Each head's own columns: the diagonal of [G, n_q, G, D] -> [n_q, G, D].
            own = attended.view(heads, num_queries, heads, head_dim).diagonal(dim1=0, dim2=2)
            attended_heads.append(own.permute(0, 2, 1))
        out[rows] = attended_heads[0] if len(attended_heads) == 1 else torch.cat(attended_heads, dim=1)


HEADS_PER_PRODUCT = 6


def heads_per_product(num_heads: int) -> int:
    """How many heads one block-diagonal product attends: the largest divisor of ``num_heads`` up to
    HEADS_PER_PRODUCT (each product does that many times the useful work)."""
    return max(d for d in range(1, min(num_heads, HEADS_PER_PRODUCT) + 1) if num_heads % d == 0)
