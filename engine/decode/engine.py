"""DecoderEngine: the continuous-batching decode loop over the paged KV cache.

It ties the pieces together and owns none of their logic: the scheduler decides who runs, hands
the step side a Batch of rows (engine/decode/batch.py: slots, tokens, positions, sampling; never a
request) and applies what the step produced, the only writer of a request's state; the pipeline
launches a step on the device and reads it back (engine/decode/step/pipeline.py explains async
steps); the fallback module decides whether a stopped window starts again, hotter; a search
(engine/decode/search/: beams, best-of samples) steps a window as several hypotheses and picks
what they continue with; the result builder turns a finished window into a DecodeResult.
Cross-attention K/V that travels (a pull from an encoder replica) loads beside the loop
(engine/decode/kv_loader.py). Deployments read the engine only through ``stats()``, a snapshot
taken on the loop thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from engine.attention.registry import make_attention_backend
from engine.config import EngineConfig
from engine.decode.alignment import alignment_heads_of
from engine.decode.fallback import restart_hotter
from engine.decode.inbox import Inbox
from engine.decode.kv_loader import CrossKVLoader
from engine.decode.prompt import build_request
from engine.decode.request import Request, RequestStatus
from engine.decode.results import ResultBuilder
from engine.decode.scheduler import Scheduler, non_finite_logits_error
from engine.decode.scheduler.rows import StepRows
from engine.decode.step.logit_rules import LogitRules
from engine.decode.step.pipeline import LaunchedStep, StepPipeline
from engine.decode.step.runner import ModelRunner
from engine.decode.timings import LoopTimings, WindowTimes
from engine.errors import RetriableError
from engine.kernels import launch_control, triton_available
from engine.kv.block_pool import BlockPool
from engine.kv.sources import CrossKVSource
from engine.kv.storage import PagedKVStorage
from engine.model.loading import LoadedModel
from engine.types import DecodeOptions, DecodeResult, FinishReason, Priority

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a K/V load to land before it returns.
LANDING_WAIT_S = 0.02


@dataclass(frozen=True)
class EngineStats:
    """The engine's load, as the loop thread last saw it: for routing, autoscaling and /metrics."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_running: int
    num_waiting: int  # submitted and not admitted yet
    num_waiting_interactive: int
    waiting_blocks: int  # what the waiting requests will reserve when admitted
    num_kv_loads: int = 0  # cross-attention K/V pulls landed beside the loop
    kv_load_p50_s: float = float("nan")  # of the recent pulls, from start to landing
    kv_load_p95_s: float = float("nan")
    timings: LoopTimings = dataclasses.field(default_factory=LoopTimings)  # sums since start


class DecoderEngine:
    """``submit`` and ``abort`` may be called from any thread; ``step`` from one thread only."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        # ``config`` may differ from the one the model loaded with in cache and batching settings.
        config = config or loaded.config
        dims = loaded.weights.dims
        self.dims = dims
        self.tokenizer = loaded.tokenizer
        self.device = config.torch_device
        self.storage, self.pool = _paged_cache(loaded, config)
        self.runner = _model_runner(loaded, config, self.storage)
        switches = config.gpu_switches(graphs_capturable=self.runner.backend.graph_safe)
        if switches.cuda_graphs:
            from engine.decode.step.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs)
        self.stepped_prompt_tokens = switches.stepped_prompt_tokens
        self.async_steps = switches.async_steps
        self.scheduler = Scheduler(
            self.pool,
            dims.n_audio_ctx,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.interactive_reserved_seqs,
            config.batch_aging_s,
            batch_share=config.batch_share,
            eot=self.tokenizer.special.eot,
            n_text_ctx=dims.n_text_ctx,
            consecutive_cross_blocks=self.runner.backend.prefers_consecutive_blocks,
            rows=StepRows(
                self.runner.tables,
                self.runner.max_cross_readers,
                dims.n_text_ctx,
                self.stepped_prompt_tokens,
                device_chooses=self.async_steps,  # beam searches choose on the device
            ),
            # The model's precision is the one it loaded in: the config here may differ in cache and
            # batching settings only.
            non_finite_error=non_finite_logits_error(str(loaded.config.torch_dtype).removeprefix("torch.")),
        )
        self.rules = LogitRules(
            self.tokenizer,
            dims.vocab_size,
            loaded.weights.suppress_tokens,
            loaded.weights.begin_suppress_tokens,
            self.device,
            num_slots=config.max_num_seqs + 1,
        )
        self.pipeline = StepPipeline(
            self.runner, self.rules, self.tokenizer, self.async_steps, self.scheduler.rows.step_input
        )
        self.loader = CrossKVLoader(
            self.storage, self.runner.project_cross_kv, self.device, workers=config.kv_load_workers
        )
        self.results = ResultBuilder(
            self.tokenizer, loaded.model, self.storage, alignment_heads_of(loaded.weights)
        )
        self._inbox = Inbox()
        self._ids = itertools.count()
        self._by_id: dict[str, Request] = {}
        self.timings = LoopTimings()
        # What one more window with default options reserves: for routing and autoscaling.
        self.blocks_per_window = self.scheduler.blocks_for(
            self.make_request(DecodeOptions(), None, "default")
        )
        self._stats = self._take_stats()
        logger.info(
            "attention backend %s, decode CUDA graphs %s, async steps %s",
            self.runner.backend.name,
            self.runner.graphs.sizes if self.runner.graphs else "off",
            self.async_steps,
        )

    def make_request(
        self,
        options: DecodeOptions,
        cross_source: CrossKVSource | None,
        request_id: str | None = None,
        audio_duration_s: float | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> Request:
        """Validate options and build a request; raises RequestRejectedError for bad options.

        ``audio_duration_s``: how much of the 30 s window is audio (word alignment looks only there)."""
        return build_request(
            self.tokenizer,
            self.dims,
            self.device,
            options,
            cross_source,
            request_id or f"req-{next(self._ids)}",
            audio_duration_s,
            self.stepped_prompt_tokens,
            priority,
        )

    def submit(self, request: Request) -> None:
        self._inbox.submit(request)

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def request_ids(self) -> list[str]:
        """Requests submitted and not finished (call from the thread that runs ``step``)."""
        return list(self._by_id)

    @property
    def has_work(self) -> bool:
        return (
            self.scheduler.has_work
            or not self._inbox.empty
            or self.pipeline.in_flight is not None
            or self.loader.num_loading > 0  # a load landing frees the blocks of a request ended meanwhile
        )

    def stats(self) -> EngineStats:
        """The last snapshot the loop thread took, with what was submitted since and the recent K/V
        pull times; safe to call from any thread."""
        stats, submitted = self._stats, self._inbox.num_requests
        load_times = sorted(self.loader.recent_load_s.copy())  # copy(): one step under the GIL
        return dataclasses.replace(
            stats,
            num_waiting=stats.num_waiting + submitted,
            waiting_blocks=stats.waiting_blocks + submitted * self.blocks_per_window,
            num_kv_loads=self.loader.num_loaded,
            kv_load_p50_s=_percentile(load_times, 0.50),
            kv_load_p95_s=_percentile(load_times, 0.95),
        )

    def step(self) -> list[DecodeResult]:
        """Admit, launch one decoder forward and sampling for every running request, and read the
        tokens of this step (or, with async steps, of the one launched before); return finished ones."""
        finished = self._take_submitted()
        finished += self._take_aborted()
        finished += self._take_landed()
        scheduled = self.scheduler.schedule()
        finished += self._load_cross_kv(scheduled.admitted)
        self.storage.copy_blocks(scheduled.block_copies)
        launched = self.pipeline.launch(self.scheduler.rows_to_step(scheduled))
        if launched is not None:
            self.timings.count_step(len(launched.batch))
        # A search that chooses its hypotheses' next tokens on the host needs them read before
        # the next step launches.
        overlap = launched is None or not launched.host_chooses
        for to_read in self.pipeline.steps_to_read(launched, overlap=overlap):
            finished += self._read(to_read)
        self._stats = self._take_stats()
        return finished

    def _read(self, launched: LaunchedStep) -> list[DecodeResult]:
        """Read a launched step's tokens; return the requests that finished (fallback restarts do not)."""
        started = time.perf_counter()
        output = self.pipeline.read(launched)
        self.timings.count_read(time.perf_counter() - started)
        self.scheduler.step_read(output.step_id)
        finished = []
        for request, reason in self.scheduler.update_from_output(output):
            undo_draw = self.pipeline.draw_undone(request.generator, request.launched_in)
            retried = reason != FinishReason.ERROR and restart_hotter(request, self.tokenizer, undo_draw)
            if not retried:
                finished.append(self._finish(request, reason))
            else:
                self._restart_on_prompt_blocks(request)
        return finished

    def _restart_on_prompt_blocks(self, request: Request) -> None:
        """A restarted window decodes its next attempt on the prompt's K/V it already holds: as one
        sequence, or as the hypotheses of a new search (best-of samples above temperature 0)."""
        if request.search is not None:
            self._end_search(request, keep_prompt=True)
        if request.num_hypotheses > 1:
            self.runner.release(request.request_id)  # its hypotheses take slots of their own
            self.scheduler.start_search(request)

    def _end_search(self, request: Request, keep_prompt: bool) -> None:
        for hypothesis in request.search.end(keep_prompt):
            self.runner.release(hypothesis.request_id)

    def _take_submitted(self) -> list[DecodeResult]:
        rejected: list[DecodeResult] = []
        for request, submitted_s in self._inbox.take_requests():
            self._by_id[request.request_id] = request
            try:
                self.scheduler.add(request, submitted_s)
            except Exception as exc:
                logger.warning("request %s rejected: %s", request.request_id, exc)
                rejected.append(self._finish(request, FinishReason.ERROR, error=str(exc)))
        return rejected

    def _take_aborted(self) -> list[DecodeResult]:
        aborted = [self._by_id.get(request_id) for request_id in self._inbox.take_aborts()]
        return [self._finish(request, FinishReason.ABORTED) for request in aborted if request is not None]

    def _load_cross_kv(self, admitted: list[Request]) -> list[DecodeResult]:
        """K/V that travels starts loading beside the loop; in-process K/V is written now."""
        failed: list[DecodeResult] = []
        for request in admitted:
            if request.cross_source.travels:
                self.scheduler.hold_for_load(request)
                self.loader.start(request)
                continue
            try:
                request.cross_source.load_into(
                    self.storage, request.blocks.cross_block_ids, self.runner.project_cross_kv
                )
            except Exception as exc:
                failed.append(self._fail_load(request, exc))
        return failed

    def _take_landed(self) -> list[DecodeResult]:
        """Loads that ended since the last step: their requests step from now on, or fail."""
        # Nothing can step until a load lands: wait for one a little rather than spin (a spinning
        # loop would also hold the GIL the loader's threads need).
        idle = not self.scheduler.has_runnable and self.pipeline.in_flight is None
        failed = []
        for load in self.loader.take_landed(LANDING_WAIT_S if idle else 0.0):
            request = load.request
            self.scheduler.landed(request, load.started_s, load.ended_s)
            if load.error is not None and request.status != RequestStatus.FINISHED:
                failed.append(self._fail_load(request, load.error))
        self.scheduler.release_held()  # blocks of requests that ended while their K/V was loading
        return failed

    def _fail_load(self, request: Request, error: BaseException) -> DecodeResult:
        """A failed K/V load (e.g. a transfer error) fails its request only, and frees its blocks."""
        logger.error("loading cross-attention K/V for %s failed: %s", request.request_id, error)
        return self._finish(
            request,
            FinishReason.ERROR,
            error=f"loading cross-attention K/V failed: {error}",
            retriable=isinstance(error, RetriableError),
        )

    def close(self) -> None:
        """Stop the K/V load workers (waiting for loads under way)."""
        self.loader.close()

    def _finish(
        self, request: Request, reason: FinishReason, error: str | None = None, retriable: bool = False
    ) -> DecodeResult:
        """End a request and return its result. A decoded one (STOP, LENGTH) gets its result while it
        still holds its blocks (word alignment reads its K/V); one that ends before admission gives
        its source's K/V up unloaded (an encoder's staging would otherwise wait for its timeout)."""
        decoded = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if decoded:
            self.timings.count_window(
                WindowTimes(
                    request.submitted_s,
                    request.admitted_s,
                    request.load_started_s,
                    request.load_ended_s,
                    request.runnable_s,
                    time.monotonic(),
                )
            )
        if request.search is not None:
            self._end_search(request, keep_prompt=False)
        result = self.results.build(request, reason) if decoded else None
        if request.status == RequestStatus.WAITING and request.cross_source is not None:
            request.cross_source.discard()
        self.scheduler.finish(request, reason, error, retriable)
        self._by_id.pop(request.request_id, None)
        self.runner.release(request.request_id)
        return result or self.results.build(request)

    def _take_stats(self) -> EngineStats:
        scheduler, pool = self.scheduler, self.pool
        return EngineStats(
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_running=scheduler.num_sequences,
            num_waiting=len(scheduler.waiting),
            num_waiting_interactive=scheduler.num_waiting_of(Priority.INTERACTIVE),
            waiting_blocks=sum(scheduler.blocks_for(request) for request in scheduler.waiting),
            timings=self.timings.snapshot(),
        )


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _paged_cache(loaded: LoadedModel, config: EngineConfig) -> tuple[PagedKVStorage, BlockPool]:
    """As many blocks as ``kv_cache_memory_mb`` holds, and the pool that hands them out."""
    dims = loaded.weights.dims
    cache_dtype = config.kv_cache_torch_dtype
    block_bytes = PagedKVStorage.bytes_per_block(
        dims.decoder_layers, config.block_size, dims.decoder_heads, dims.head_dim, cache_dtype
    )
    num_blocks = int(config.kv_cache_memory_mb * 2**20) // block_bytes
    pool = BlockPool(num_blocks, config.block_size)
    storage = PagedKVStorage(
        num_blocks,
        dims.decoder_layers,
        config.block_size,
        dims.decoder_heads,
        dims.head_dim,
        cache_dtype,
        config.torch_device,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MB, %s)",
        num_blocks,
        config.block_size,
        num_blocks * block_bytes / 2**20,
        str(cache_dtype).removeprefix("torch."),
    )
    return storage, pool


def _model_runner(loaded: LoadedModel, config: EngineConfig, storage: PagedKVStorage) -> ModelRunner:
    device = config.torch_device
    backend = make_attention_backend(
        config.attention_backend, device, block_size=config.block_size, dtype=config.kv_cache_torch_dtype
    )
    switches = config.gpu_switches()
    if switches.fused_decoder_norms and triton_available():
        loaded.model.decoder.fuse_residual_norms()  # before the decode graphs capture the step
    # Only where the kernels' launches overlap (Hopper and later), where they beat cuBLAS. Set
    # either way: benchmarks build several engines on one loaded model.
    overlapping = triton_available() and launch_control(device)
    loaded.model.decoder.use_small_rows_products(switches.small_rows_products if overlapping else 0)
    return ModelRunner(loaded.model, storage, backend, config.max_num_seqs)
