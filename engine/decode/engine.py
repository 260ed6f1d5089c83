"""The two halves the deployments wrap: EncoderRunner (windows -> cross-K/V) and DecoderEngine
(the continuous-batching step loop over the paged cache).

``load_model`` builds the shared pieces once; an encoder replica and a decoder replica each call it.

A decoder step is launched, then read: launching schedules, runs the forward, applies the logit
rules and samples, all on the device, leaving the tokens on their way to the host; reading them
appends them to their requests and ends those that are done. With ``engine.async_steps`` the
engine reads a step only after launching the next one (feeding it the tokens still on the device),
so the host's work for one step overlaps the device's for the next, as TensorRT-LLM's overlap
scheduler and vLLM's async scheduling do. The price: a window that ends at end of text has run
one step too many, whose row is dropped, and its blocks are freed once that step is done.
"""

from __future__ import annotations

import itertools
import logging
import queue
from dataclasses import dataclass, field

import torch

from engine.decode.alignment import align_words, alignment_heads_of
from engine.attention.registry import make_attention_backend
from engine.model.audio import CHUNK_LENGTH_S, N_SAMPLES, log_mel_spectrogram
from engine.config import EngineConfig
from engine.decode.decoding import (
    LogitRules, build_prompt, compression_ratio, detect_language, is_silence, needs_fallback, sample, timed_segments,
)
from engine.errors import RetriableError
from engine.decode.host_device import PendingDownload, upload
from engine.kv.block_pool import BlockPool
from engine.kv.storage import PagedKVStorage, to_cache_dtype
from engine.model.whisper import Whisper
from engine.decode.runner import ModelRunner
from engine.decode.request import FROM_LAST_STEP, Request, RequestStatus
from engine.kv.sources import CrossKVSource
from engine.types import DecodeOptions, DecodeResult, FinishReason
from engine.decode.scheduler import Scheduler
from engine.model.tokenizer import WhisperTokenizer
from engine.model.weights import LoadedWeights, load_weights

logger = logging.getLogger(__name__)

FALLBACK_SEED = 0
# Whisper's own prompt is 2 to 4 tokens (<|startoftranscript|>, language, task, <|notimestamps|>);
# fed one a step they cost a new request 3 steps more, against an eager step for everyone.
DEFAULT_STEPPED_PROMPT_TOKENS = 8


@dataclass
class LoadedModel:
    weights: LoadedWeights
    model: Whisper
    tokenizer: WhisperTokenizer
    config: EngineConfig


def load_model(config: EngineConfig, weights: LoadedWeights | None = None) -> LoadedModel:
    """Load ``config.model`` (or take ``weights`` already in memory) onto the configured device."""
    config.check_device_present()
    weights = weights or load_weights(config.model)
    with torch.device("meta"):
        model = Whisper(weights.dims)
    model = model.to_empty(device=config.torch_device).to(config.torch_dtype)
    model.load_canonical_state_dict(weights.state_dict)
    model.eval()
    weights.state_dict = {}  # the model holds the (fused) weights now; free the loader's copy
    return LoadedModel(weights, model, WhisperTokenizer(weights.tokenizer_file, weights.dims.vocab_size), config)


class EncoderRunner:
    """Batches of 30 s windows -> encoder states -> each window's cross-attention K/V."""

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.dims = loaded.weights.dims
        self.device = loaded.config.torch_device
        self.dtype = loaded.config.torch_dtype
        self.kv_cache_dtype = loaded.config.kv_cache_torch_dtype
        if loaded.config.fused_encoder_gelu and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16):
            self.model.encoder.fuse_gelu()  # before compiling: the compiled graph takes the fused product
        if loaded.config.compile_encoder and self.device.type == "cuda":
            # Measured on an H100 (large-v3 shape, bf16, 64 windows): 160 -> 209 windows/s compiling
            # the whole encoder, 197 compiling each layer alone (fusions across layers count).
            if not getattr(self.model.encoder, "_compiled_call_impl", None):
                self.model.encoder.compile()
            # Compile now, not in a request: a second batch size makes the graph batch-dynamic.
            for batch in (1, 2):
                self.encode(torch.zeros(batch, N_SAMPLES))

    @torch.inference_mode()
    def encode(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [N, 480000] float32 samples (padded) -> encoder states [N, 1500, d_model]."""
        mels = log_mel_spectrogram(windows.to(self.device), self.dims.n_mels)
        return self.model.encoder(mels.to(self.dtype))

    @torch.inference_mode()
    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[N, 1500, d] -> [N, layers, 2, 1500, H, D], in the KV cache's dtype: the bytes a decoder's
        blocks hold, so a transfer copies them as they are (and an fp8 cache ships half the bytes)."""
        return to_cache_dtype(self.model.decoder.project_cross_kv(states), self.kv_cache_dtype)


# Rows of a launched step's read-back: the token (sampled, or the detected language), its
# log-probability, and at <|startoftranscript|> the no-speech probability.
_TOKEN, _LOGPROB, _NO_SPEECH = range(3)


@dataclass
class LaunchedStep:
    """A step on its way through the device, and what reading its tokens back needs."""

    step_id: int
    batch: list[Request]
    epochs: list[int]  # each row's request.epoch at launch: a row of a window restarted since is stale
    sampling_rows: list[int]
    sot_rows: list[int]  # rows that fed <|startoftranscript|>: their no-speech probability is read
    detect_rows: list[int]  # of those, rows whose language is detected there
    computed_after: list[int]  # each row's tokens in the cache once this step has run
    readback: PendingDownload  # [3, rows] float32: _TOKEN, _LOGPROB, _NO_SPEECH
    # Per request that sampled with its own generator: the generator's state before this step's draw.
    generator_states: dict[str, torch.Tensor] = field(default_factory=dict)
    # Requests that ended while this step ran with them: their blocks are freed once it is done.
    release_after: list[Request] = field(default_factory=list)


class DecoderEngine:
    """Owns the block pool, the scheduler and the runner; ``step()`` advances every request once.

    ``submit`` and ``abort`` may be called from any thread: they queue work that the thread
    calling ``step`` picks up at its next step boundary.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        # ``config`` may differ from the one the model loaded with in cache and batching settings.
        config = config or loaded.config
        dims = loaded.weights.dims
        self.dims = dims
        self.tokenizer = loaded.tokenizer
        self.device = config.torch_device
        cache_dtype = config.kv_cache_torch_dtype
        block_bytes = PagedKVStorage.bytes_per_block(
            dims.decoder_layers, config.block_size, dims.decoder_heads, dims.head_dim, cache_dtype
        )
        num_blocks = int(config.kv_cache_memory_mb * 2**20) // block_bytes
        self.pool = BlockPool(num_blocks, config.block_size)
        storage = PagedKVStorage(
            num_blocks, dims.decoder_layers, config.block_size, dims.decoder_heads, dims.head_dim,
            cache_dtype, self.device,
        )
        backend = make_attention_backend(config.attention_backend, self.device, block_size=config.block_size,
                                         dtype=cache_dtype)
        if config.fused_decoder_norms and self.device.type == "cuda":
            from engine.kernels import triton_available

            if triton_available():
                loaded.model.decoder.fuse_residual_norms()  # before the decode graphs capture the step
        self.runner = ModelRunner(loaded.model, storage, backend, config.max_num_seqs)
        if config.cuda_graphs and self.device.type == "cuda" and backend.graph_safe:
            from engine.decode.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs)
        self.stepped_prompt_tokens = config.stepped_prompt_tokens
        if self.stepped_prompt_tokens is None:
            self.stepped_prompt_tokens = DEFAULT_STEPPED_PROMPT_TOKENS if self.runner.graphs else 0
        self.scheduler = Scheduler(self.pool, dims.n_audio_ctx, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.interactive_reserved_seqs, config.batch_aging_s)
        self.rules = LogitRules(
            self.tokenizer, dims.vocab_size, loaded.weights.suppress_tokens,
            loaded.weights.begin_suppress_tokens, self.device, num_slots=config.max_num_seqs + 1,
        )
        self.async_steps = config.async_steps if config.async_steps is not None else self.runner.graphs is not None
        self._in_flight: LaunchedStep | None = None  # launched and not read yet (async steps only)
        self._step_ids = itertools.count()
        self._language_of_token = {token: code for code, token in self.tokenizer.language_tokens.items()} \
            if dims.is_multilingual else {}
        self.alignment_heads = alignment_heads_of(loaded.weights)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._by_id: dict[str, Request] = {}
        logger.info("KV cache: %d blocks of %d tokens (%.1f MB, %s), backend %s, decode CUDA graphs %s, async steps %s",
                    num_blocks, config.block_size, num_blocks * block_bytes / 2**20,
                    str(cache_dtype).removeprefix("torch."), backend.name,
                    self.runner.graphs.sizes if self.runner.graphs else "off", self.async_steps)

    def make_request(
        self, options: DecodeOptions, cross_source: CrossKVSource | None, request_id: str | None = None,
        audio_duration_s: float | None = None,
    ) -> Request:
        """Validate options and build a request; raises RequestRejectedError for bad options.

        ``audio_duration_s``: how much of the 30 s window is audio (word alignment looks only there)."""
        prompt = build_prompt(self.tokenizer, self.dims, options)
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_tokens=prompt.tokens,
            sot_index=prompt.sot_index,
            max_tokens=prompt.max_tokens,
            options=options,
            cross_source=cross_source,
            detect_language=prompt.detect_language,
            temperature=options.temperature,
            audio_duration_s=audio_duration_s,
        )
        request.pending_tokens = self._next_prompt_tokens(request)
        # A greedy decode's fallback samples from a fixed seed unless given one, so its transcript
        # is the same on every run and replica, offline and over HTTP; a temperature asked for
        # stays random.
        seed = options.seed if options.seed is not None or options.temperature > 0 else FALLBACK_SEED
        if seed is not None and max(options.temperatures()) > 0:
            request.generator = torch.Generator(device=self.device).manual_seed(seed)
        if not self.dims.is_multilingual:
            request.language = "en"
        elif options.language is not None:
            request.language = options.language
        return request

    def submit(self, request: Request) -> None:
        self._inbox.put(request)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)

    @staticmethod
    def _discard_unloaded(request: Request) -> None:
        """A request ending before admission never loaded its K/V: let its source free them now
        (an encoder's staging would otherwise stay held until its unclaimed timeout)."""
        if request.status == RequestStatus.WAITING and request.cross_source is not None:
            request.cross_source.discard()

    def request_ids(self) -> list[str]:
        """Requests submitted and not finished (call from the thread that runs ``step``)."""
        return list(self._by_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or not self._inbox.empty() or self._in_flight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._inbox.qsize()

    def step(self) -> list[DecodeResult]:
        """Admit, launch one decoder forward and sampling for every running request, and read the
        tokens of this step (or, with async steps, of the one launched before); return finished ones."""
        finished = self._take_submitted_and_aborted()
        launched = self._launch(finished)
        if self.async_steps:
            previous, self._in_flight = self._in_flight, launched
        else:
            previous = launched
        if previous is not None:
            finished.extend(self._read(previous))
        return finished

    def _take_submitted_and_aborted(self) -> list[DecodeResult]:
        finished: list[DecodeResult] = []
        while not self._inbox.empty():
            request = self._inbox.get()
            self._by_id[request.request_id] = request
            try:
                self.scheduler.add(request)
            except Exception as exc:
                logger.warning("request %s rejected: %s", request.request_id, exc)
                self._discard_unloaded(request)
                request.status, request.finish_reason, request.error = RequestStatus.FINISHED, FinishReason.ERROR, str(exc)
                finished.append(self._result(request))
        while not self._aborts.empty():
            request = self._by_id.get(self._aborts.get())
            if request is not None:
                self._discard_unloaded(request)
                self._finish(request, FinishReason.ABORTED)
                finished.append(self._result(request))
        return finished

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """End a request; if the step in flight runs it, its blocks stay held until that step is read."""
        in_flight = self._in_flight
        still_running = in_flight is not None and request.launched_in == in_flight.step_id
        self.scheduler.finish(request, reason, keep_blocks=still_running)
        if still_running:
            in_flight.release_after.append(request)

    def _ends_with_unread_token(self, request: Request) -> bool:
        """Whether the token it sampled in the step in flight is its last by length: then it need
        not run again (a window ending at end of text cannot be told apart before reading)."""
        if not request.unread_tokens:
            return False
        return (len(request.output_tokens) + request.unread_tokens >= request.max_tokens
                or request.num_computed_tokens + 1 >= self.dims.n_text_ctx)

    @torch.inference_mode()
    def _launch(self, finished: list[DecodeResult]) -> LaunchedStep | None:
        scheduled = self.scheduler.schedule()
        for request in scheduled.admitted:
            try:
                request.cross_source.load_into(self.runner.storage, request.blocks.cross_block_ids, self.runner.project_cross_kv)
            except Exception as exc:
                # A failed K/V load (e.g. a transfer error) fails this request only, and frees its blocks.
                logger.exception("loading cross-attention K/V for %s failed", request.request_id)
                self._finish(request, FinishReason.ERROR)
                request.error = f"loading cross-attention K/V failed: {exc}"
                request.error_retriable = isinstance(exc, RetriableError)
                finished.append(self._result(request))
        batch = [r for r in scheduled.batch if r.finish_reason is None and not self._ends_with_unread_token(r)]
        if not batch:
            return None

        step_id = next(self._step_ids)
        logits = self.runner.execute(batch)
        sampling_rows: list[int] = []
        sot_rows: list[int] = []
        detect_rows: list[int] = []
        computed_after: list[int] = []
        for row, request in enumerate(batch):
            start, fed = request.num_computed_tokens, len(request.pending_tokens)
            feeds_sot = start <= request.sot_index < start + fed
            if feeds_sot:
                sot_rows.append(row)
            request.num_computed_tokens = start + fed
            request.launched_in = step_id
            computed_after.append(request.num_computed_tokens)
            if feeds_sot and request.detect_language:
                # The rest of the prompt starts with the language detected here, on the device.
                detect_rows.append(row)
                request.detect_language = False
                request.pending_tokens = self._next_prompt_tokens(request)
                request.pending_tokens[0], request.pending_source_row = FROM_LAST_STEP, row
            elif request.num_computed_tokens < len(request.prompt_tokens):
                # The rest of the prompt (language, task, timestamp tokens) runs before any sampling.
                request.pending_tokens = self._next_prompt_tokens(request)
            else:
                sampling_rows.append(row)
        readback = torch.zeros((3, len(batch)), dtype=torch.float32, device=self.device)
        generator_states = self._sample(logits.last, logits.slots, batch, sampling_rows, readback) if sampling_rows else {}
        if sot_rows:
            self._read_sot_logits(logits.at_sot, sot_rows, detect_rows, readback)
        self.runner.next_tokens[: len(batch)] = readback[_TOKEN].long()
        return LaunchedStep(
            step_id=step_id, batch=batch, epochs=[r.epoch for r in batch], sampling_rows=sampling_rows,
            sot_rows=sot_rows, detect_rows=detect_rows, computed_after=computed_after,
            readback=PendingDownload(readback), generator_states=generator_states,
        )

    def _sample(self, all_logits: torch.Tensor, slots: list[int], batch: list[Request], rows: list[int],
                readback: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logit rules and sampling for the rows ``rows``, on the device, into ``readback``; returns
        the generators' states before their draws."""
        requests = [batch[row] for row in rows]
        every_row = len(rows) == len(batch)
        row_index = None if every_row else upload(rows, torch.long, self.device)
        row_logits = all_logits if every_row else all_logits[row_index]  # the usual step: no gather
        first = [not r.output_tokens and not r.unread_tokens for r in requests]
        timestamps = [r.options.timestamps for r in requests]
        row_slots = slots if every_row else [slots[row] for row in rows]
        stamp_rows = self.rules.timestamp_rows(first, timestamps, row_slots)
        self.rules.apply(row_logits, first, stamp_rows)
        generator_states = {r.request_id: r.generator.get_state() for r in requests
                            if r.generator is not None and r.temperature > 0}
        tokens, logprobs = sample(row_logits, [r.temperature for r in requests], [r.generator for r in requests])
        self.rules.record(tokens, stamp_rows)
        if every_row:
            readback[_TOKEN] = tokens
            readback[_LOGPROB] = logprobs
        else:
            readback[_TOKEN].index_copy_(0, row_index, tokens.float())
            readback[_LOGPROB].index_copy_(0, row_index, logprobs.float())
        for row, request in zip(rows, requests):
            request.pending_tokens, request.pending_source_row = [FROM_LAST_STEP], row
            request.unread_tokens += 1
        return generator_states

    def _read_sot_logits(self, at_sot: dict[int, torch.Tensor], sot_rows: list[int], detect_rows: list[int],
                         readback: torch.Tensor) -> None:
        """No-speech probabilities, and detected languages, from the logits at <|startoftranscript|>."""
        sot_logits = torch.stack([at_sot[row] for row in sot_rows])
        no_speech = torch.softmax(sot_logits, dim=-1)[:, self.tokenizer.special.no_speech]
        readback[_NO_SPEECH].index_copy_(0, upload(sot_rows, torch.long, self.device), no_speech)
        if detect_rows:
            local = upload([sot_rows.index(row) for row in detect_rows], torch.long, self.device)
            languages = detect_language(self.tokenizer, sot_logits[local])
            readback[_TOKEN].index_copy_(0, upload(detect_rows, torch.long, self.device), languages.float())

    def _read(self, step: LaunchedStep) -> list[DecodeResult]:
        """Wait for a launched step's tokens; append them, end the requests that are done."""
        values = step.readback.wait()
        for request in step.release_after:
            self.scheduler.release_blocks(request)
        sot_rows, detect_rows, sampling_rows = set(step.sot_rows), set(step.detect_rows), set(step.sampling_rows)
        eot = self.tokenizer.special.eot
        finished: list[DecodeResult] = []
        for row, request in enumerate(step.batch):
            if request.status == RequestStatus.FINISHED or request.epoch != step.epochs[row]:
                continue  # ended, or started again, since: the row is stale
            token = int(values[_TOKEN, row])
            if row in sot_rows:
                request.no_speech_prob = float(values[_NO_SPEECH, row])
            if row in detect_rows:
                request.language = self._language_of_token[token]
                request.prompt_tokens[request.sot_index + 1] = token
            if request.launched_in == step.step_id and request.fed_from_row >= 0:
                request.pending_tokens[0] = token  # no later step ran it: the next one takes it from the host
            if row not in sampling_rows:
                continue
            request.unread_tokens -= 1
            request.sum_logprob += float(values[_LOGPROB, row])
            if token == eot and not request.options.ignore_eot:
                done = FinishReason.STOP
            else:
                request.output_tokens.append(token)
                full = step.computed_after[row] + 1 >= self.dims.n_text_ctx
                done = FinishReason.LENGTH if len(request.output_tokens) >= request.max_tokens or full else None
            if done is not None and not self._retry_hotter(request):
                finished.append(self._result(request, done))
                self._finish(request, done)
        return finished

    def _next_prompt_tokens(self, request: Request) -> list[int]:
        """The prompt tokens to feed at the request's next step: one, while the rest of the prompt is
        short enough to feed a token a step (see ``stepped_prompt_tokens``), else all of it."""
        # With detection pending, feed only up to <|startoftranscript|>; the language comes next.
        end = request.sot_index + 1 if request.detect_language else len(request.prompt_tokens)
        rest = request.prompt_tokens[request.num_computed_tokens : end]
        return rest[:1] if len(rest) <= self.stepped_prompt_tokens else rest

    def _avg_logprob(self, request: Request) -> float:
        # openai-whisper divides by (sampled tokens + 1): the end-of-text token counts too.
        return request.sum_logprob / (len(request.output_tokens) + 1)

    def _retry_hotter(self, request: Request) -> bool:
        """Temperature fallback: if the window's text fails the thresholds and a hotter temperature
        is left, start its text again at that temperature and return True.

        The request keeps its blocks: the cross-attention K/V is unchanged (no re-encode) and so is
        the prompt's self-attention K/V, so only the last prompt token is fed again for its logits."""
        fallback = request.options.fallback
        temperatures = request.options.temperatures()
        if fallback is None or request.attempt + 1 >= len(temperatures):
            return False
        text = self.tokenizer.decode(request.output_tokens)
        if not needs_fallback(fallback, text, self._avg_logprob(request), request.no_speech_prob or 0.0):
            return False
        in_flight = self._in_flight
        if in_flight is not None and request.launched_in == in_flight.step_id:
            # The step in flight drew its row's token from the generator: undo that draw, so the
            # next attempt samples what it would have without async steps.
            state = in_flight.generator_states.get(request.request_id)
            if state is not None:
                request.generator.set_state(state)
        request.attempt += 1
        request.epoch += 1
        request.temperature = temperatures[request.attempt]
        request.output_tokens, request.sum_logprob, request.unread_tokens = [], 0.0, 0
        request.num_computed_tokens = len(request.prompt_tokens) - 1
        request.pending_tokens = request.prompt_tokens[-1:]
        return True

    def _result(self, request: Request, reason: FinishReason | None = None) -> DecodeResult:
        """The request's result; for a decoded one (``reason`` given), called while it still holds
        its blocks, since word alignment reads its cross-attention K/V."""
        self._by_id.pop(request.request_id, None)
        self.runner.release(request.request_id)
        options = request.options
        tokens = list(request.output_tokens)
        text = self.tokenizer.decode(tokens)
        avg_logprob = self._avg_logprob(request)
        no_speech_prob = request.no_speech_prob if request.no_speech_prob is not None else float("nan")
        silent = options.fallback is not None and reason is not None and is_silence(options.fallback, avg_logprob, no_speech_prob)
        if silent:
            tokens, text = [], ""  # openai-whisper skips a window it judges silent
        # The tail segment runs to the window's end; the transcript clamps it to the audio's.
        segments = timed_segments(self.tokenizer, tokens, CHUNK_LENGTH_S) if options.timestamps else None
        if options.word_timestamps and reason is not None:
            segments = align_words(self.runner.model, self.runner.storage, self.tokenizer, self.alignment_heads, request, segments)
        return DecodeResult(
            request_id=request.request_id,
            tokens=tokens,
            text=text,
            avg_logprob=avg_logprob,
            no_speech_prob=no_speech_prob,
            language=request.language,
            temperature=request.temperature,
            finish_reason=reason or request.finish_reason,
            error=request.error,
            retriable=request.error_retriable,
            segments=segments,
            compression_ratio=compression_ratio(text),
            no_speech=silent,
        )
