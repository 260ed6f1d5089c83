"""Cross-attention K/V loads beside the decode loop.

A window's K/V that must travel (a pull from an encoder replica over NIXL or the object store)
loads on a worker thread while the loop keeps stepping the windows it already holds: a slow or
failed pull delays only its own window. The scheduler keeps an admitted window out of the steps
until its load has landed (``Request.cross_kv_loading``), as vLLM's scheduler keeps a request that
waits for remote KVs. In-process K/V (the offline API's) loads inline, at admission.

On a GPU the worker writes on a stream of its own and records an event after the load; the loop's
stream waits for that event (on the device, never the host) before the window's first step reads
its blocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.decode.request import Request
from engine.kv.sources import CrossKVSource, StateProjection
from engine.kv.storage import PagedKVStorage

# Load times kept for the percentiles the decoder reports (the most recent ones).
RECENT_LOADS = 1000


@dataclass
class _Load:
    request: Request
    landed: Future  # the load's CUDA event (None off the GPU), or its exception
    # time.monotonic() when a worker began and ended it (written by the worker before ``landed`` is done).
    started_s: float = 0.0
    ended_s: float = 0.0


@dataclass(frozen=True)
class LandedLoad:
    """A load that has ended: landed, or failed with ``error``."""

    request: Request
    error: BaseException | None
    started_s: float
    ended_s: float


class CrossKVLoader:
    def __init__(
        self,
        storage: PagedKVStorage,
        project_states: StateProjection,
        device: torch.device,
        workers: int = 2,  # engine.kv_load_workers
    ):
        self.storage = storage
        self.project_states = project_states
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-load")
        self._loads: list[_Load] = []
        self._some_landed = threading.Event()
        self.recent_load_s: deque[float] = deque(maxlen=RECENT_LOADS)  # start of a load to its landing
        self.num_loaded = 0

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def start(self, request: Request) -> None:
        """Load ``request``'s K/V into its cross-attention blocks on a worker thread (the scheduler
        keeps it out of the steps until it has landed)."""
        load = _Load(request, Future())
        load.landed = self._workers.submit(
            self._load, load, request.cross_source, list(request.blocks.cross_block_ids)
        )
        load.landed.add_done_callback(lambda _: self._some_landed.set())
        self._loads.append(load)

    def _load(self, load: _Load, source: CrossKVSource, block_ids: list[int]) -> torch.cuda.Event | None:
        """On a worker thread: the load, timed on its record (the loop reads it once it has landed)."""
        load.started_s = time.monotonic()
        try:
            landed = self._load_on_stream(source, block_ids)
        finally:
            load.ended_s = time.monotonic()
        self.recent_load_s.append(load.ended_s - load.started_s)  # (thread-safe)
        return landed

    def _load_on_stream(self, source, block_ids: list[int]) -> torch.cuda.Event | None:
        if self._stream is None:
            source.load_into(self.storage, block_ids, self.project_states)
            return None
        with torch.cuda.stream(self._stream), torch.inference_mode():
            source.load_into(self.storage, block_ids, self.project_states)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        return landed

    def take_landed(self, wait_s: float = 0.0) -> list[LandedLoad]:
        """The loads that have ended since the last call; waits up to ``wait_s`` for one when none
        has (the loop has nothing else to do)."""
        self._some_landed.clear()
        if wait_s > 0 and self._loads and not any(load.landed.done() for load in self._loads):
            self._some_landed.wait(wait_s)
        ended, still_loading = [], []
        for load in self._loads:  # one pass: a load may land while this runs
            (ended if load.landed.done() else still_loading).append(load)
        self._loads = still_loading
        outcomes = []
        for load in ended:
            error = load.landed.exception()
            if error is None and load.landed.result() is not None:
                torch.cuda.current_stream(self.device).wait_event(load.landed.result())
            self.num_loaded += error is None
            outcomes.append(LandedLoad(load.request, error, load.started_s, load.ended_s))
        return outcomes

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)
