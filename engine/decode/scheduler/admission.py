"""Which waiting request the scheduler admits next, and whether it fits: the priorities' rules.

Priorities decide admission only; every admitted request runs at every step. The next request to
admit is the oldest interactive one, or the oldest batch one when no interactive request waits,
except while running batch requests hold fewer than their share of the sequence slots
(``batch_share`` of ``max_num_seqs``, engine/types.py ``batch_places``): then the oldest batch
request is next, and is admitted as interactive work would be. So under any interactive load a long
file's windows keep that share of every step's rows. The share is a floor reached as slots free up:
nothing admitted is taken back for it.

Beyond its share, batch work fills the capacity interactive work leaves: it is admitted only while
``interactive_reserved_seqs`` sequence slots (and room in the pool for that many more requests of
its size) stay free, so an interactive request arriving behind a batch backlog is admitted at the
next step instead of waiting for batch windows to finish. A batch window that cannot be admitted
waits holding nothing (no blocks, no slot; its K/V stays staged at the encoder), and once admitted
it is never parked: a window that holds blocks and produces nothing costs the slots and memory
interactive work could use and only lengthens its own latency. A batch request that has waited
``batch_aging_s`` while no batch request runs ranks as interactive (so even where there is no share
to give, one slot, an interactive stream delays batch work by at most that long, never forever).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.decode.request import Request
from engine.kv.block_pool import BlockPool
from engine.types import Priority, batch_places, is_promoted


@dataclass(frozen=True)
class Admission:
    """engine.config's fields of the same names; reads requests, never writes them."""

    max_num_seqs: int
    interactive_reserved_seqs: int = 0
    batch_aging_s: float = 30.0
    batch_share: float = 0.0
    batch_seqs_owed: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_seqs_owed", batch_places(self.max_num_seqs, self.batch_share))

    def next_to_admit(self, waiting: list[Request], running: list[Request], now: float) -> Request:
        """Of ``waiting`` (in arrival order, not empty): the oldest batch request while batch work is
        owed a slot, else the oldest request that ranks as interactive now, else the oldest one."""
        if self._batch_is_owed_a_slot(running):
            for request in waiting:
                if request.priority == Priority.BATCH:
                    return request
        for request in waiting:
            if self._admits_as_interactive(request, running, now):
                return request
        return waiting[0]

    def fits(
        self, request: Request, needed_blocks: int, running: list[Request], pool: BlockPool, now: float
    ) -> bool:
        """Whether ``request``, needing ``needed_blocks``, may join ``running`` now."""
        sequences = sum(r.options.max_hypotheses for r in running) + request.options.max_hypotheses
        owed = request.priority == Priority.BATCH and self._batch_is_owed_a_slot(running)
        if owed or self._admits_as_interactive(request, running, now):
            return sequences <= self.max_num_seqs and pool.can_allocate(needed_blocks)
        reserved = self.interactive_reserved_seqs
        return sequences <= self.max_num_seqs - reserved and pool.can_allocate(needed_blocks * (1 + reserved))

    def _batch_is_owed_a_slot(self, running: list[Request]) -> bool:
        if not self.batch_seqs_owed:
            return False
        held = sum(r.options.max_hypotheses for r in running if r.priority == Priority.BATCH)
        return held < self.batch_seqs_owed

    def _admits_as_interactive(self, request: Request, running: list[Request], now: float) -> bool:
        # Aging is against starvation: while batch requests are running, batch work makes progress
        # and its waiting requests keep their rank (or a long backlog would age into interactive's).
        if request.priority == Priority.BATCH and any(r.priority == Priority.BATCH for r in running):
            return False
        return is_promoted(request.priority, now - request.waiting_since_s, self.batch_aging_s)
