"""Continuous batching: who joins, who runs, who leaves, at every decoder step.

Admission reserves the worst case. A request is admitted only when the pool can give it all its
cross-attention blocks and self-attention blocks for its prompt plus ``max_tokens``; Whisper's
448-token text context caps that at ~28 blocks of 16 beside the ~94 cross blocks it needs anyway,
so reserving costs little memory, and in exchange no running request can ever run out of blocks:
no preemption, no recomputation, no deadlock when the pool is full. Waiting requests are admitted
in arrival order (the head waits for room rather than being overtaken, so large prompts cannot
starve); every step runs every admitted request, so a short request never waits for a long one
to finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.errors import CacheFullError
from engine.kv_cache import BlockPool, blocks_needed
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledStep:
    admitted: list[Request]  # joined this step: their cross-attention K/V must be loaded first
    batch: list[Request]  # every request that runs this step, admitted ones included


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        cross_tokens_per_request: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.pool = pool
        self.cross_blocks_per_request = blocks_needed(cross_tokens_per_request, pool.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def blocks_for(self, request: Request) -> int:
        return self.cross_blocks_per_request + blocks_needed(request.max_total_tokens, self.pool.block_size)

    def add(self, request: Request) -> None:
        if self.blocks_for(request) > self.pool.num_blocks:
            raise CacheFullError(
                f"request {request.request_id} needs {self.blocks_for(request)} KV blocks, the whole "
                f"cache has {self.pool.num_blocks}: raise kv_cache_memory_mb"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens - sum(len(r.pending_tokens) for r in self.running)
        admitted: list[Request] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            needed = self.blocks_for(request)
            if not self.pool.can_allocate(needed) or len(request.pending_tokens) > budget:
                break
            self.waiting.popleft()
            request.blocks.cross_block_ids = self.pool.allocate(self.cross_blocks_per_request)
            request.blocks.self_block_ids = self.pool.allocate(needed - self.cross_blocks_per_request)
            request.status = RequestStatus.RUNNING
            budget -= len(request.pending_tokens)
            self.running.append(request)
            admitted.append(request)
        return ScheduledStep(admitted=admitted, batch=list(self.running))

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take a request out, wherever it is, and return its blocks; safe to call once per request."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.pool.free(request.blocks.all_ids())
        request.blocks.self_block_ids, request.blocks.cross_block_ids = [], []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.cross_source = None  # drop the K/V it came with
