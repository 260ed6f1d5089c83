"""Prometheus metrics: request counts and latency from the ingress, the seconds of audio it
transcribed by model and API key (what an operator bills), and, at each scrape, the encoder,
decoder and diarizer replicas' own figures (KV blocks, queues, batch sizes, audio diarized)."""

from __future__ import annotations

import hashlib
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
ANONYMOUS = "anonymous"  # the API key label where the server has no keys configured


def api_key_label(key: str | None) -> str:
    """The label that tells an API key's usage apart without showing the key: anyone who can
    scrape /metrics (which needs no key) must not read keys off it. The first 8 hex digits of its
    SHA-256 are stable across replicas and restarts, and an operator computes them from the keys
    they issued. None (no keys configured): ``ANONYMOUS``."""
    if key is None:
        return ANONYMOUS
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class ServingMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "whisper_requests",
            "HTTP requests by route, model (empty before a request names one) and status",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "whisper_request_latency_seconds",
            "end-to-end request latency",
            ["route", "model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.audio_seconds = Counter(
            "whisper_audio_seconds",
            "seconds of audio transcribed (the usage the responses report), by the model the requests "
            "named and their API key's label (the first 8 hex digits of its SHA-256, or anonymous)",
            ["model", "api_key"],
            registry=self.registry,
        )
        self.kv_blocks_used = Gauge(
            "whisper_decoder_kv_blocks_used", "KV blocks in use", ["model", "replica"], registry=self.registry
        )
        self.kv_blocks_free = Gauge(
            "whisper_decoder_kv_blocks_free", "KV blocks free", ["model", "replica"], registry=self.registry
        )
        self.decoder_running = Gauge(
            "whisper_decoder_running", "windows decoding", ["model", "replica"], registry=self.registry
        )
        self.decoder_waiting = Gauge(
            "whisper_decoder_waiting",
            "windows waiting for KV blocks",
            ["model", "replica"],
            registry=self.registry,
        )
        self.decoder_tokens = Gauge(
            "whisper_decoder_tokens_generated",
            "tokens decoded since start (the decoder's own count, fallback retries excluded)",
            ["model", "replica"],
            registry=self.registry,
        )
        self.kv_loads = Gauge(
            "whisper_decoder_kv_loads",
            "cross-attention K/V pulls landed in the decoder",
            ["model", "replica"],
            registry=self.registry,
        )
        self.kv_load_seconds = Gauge(
            "whisper_decoder_kv_load_seconds",
            "recent cross-attention K/V pull times, start to landing, by quantile",
            ["model", "replica", "quantile"],
            registry=self.registry,
        )
        self.decoder_aborted = Gauge(
            "whisper_decoder_windows_aborted",
            "windows aborted because their caller went away",
            ["model", "replica"],
            registry=self.registry,
        )
        self.encoder_batch_size = Gauge(
            "whisper_encoder_mean_batch_size",
            "mean windows per encoder forward",
            ["model", "replica"],
            registry=self.registry,
        )
        self.encoder_windows = Gauge(
            "whisper_encoder_windows_encoded",
            "windows encoded since start",
            ["model", "replica"],
            registry=self.registry,
        )
        self.transfer = Gauge(
            "whisper_transfer_info",
            "the transfer connector and payload in use",
            ["model", "replica", "connector", "payload"],
            registry=self.registry,
        )
        self.encoder_precision = Gauge(
            "whisper_encoder_precision_info",
            "the precision the encoder runs in (engine.dtype, engine.cpu_dtype, FP8 products)",
            ["model", "replica", "precision"],
            registry=self.registry,
        )
        self.encoder_staged = Gauge(
            "whisper_encoder_staged",
            "windows whose K/V awaits a decoder pull",
            ["model", "replica"],
            registry=self.registry,
        )

        # Where a window's time goes, summed since each replica started (differences over an
        # interval give means: benchmarks/bench_load.py): the encoder's queue and forward, the
        # decoder's queue, K/V load and steps, and the decode batch.
        self.encoder_window_seconds = Gauge(
            "whisper_encoder_window_seconds",
            "windows' time in the encoder by stage (queued: arrival to forward; forward: its batch's "
            "encode and the staging up to its own), summed since start",
            ["model", "replica", "stage"],
            registry=self.registry,
        )
        self.encoder_batches = Gauge(
            "whisper_encoder_batches",
            "encoder batches since start",
            ["model", "replica"],
            registry=self.registry,
        )
        self.encoder_forwards = Gauge(
            "whisper_encoder_forwards",
            "encoder forwards since start: one for each context (encoder frames) among a batch's windows",
            ["model", "replica"],
            registry=self.registry,
        )
        self.encoder_busy_seconds = Gauge(
            "whisper_encoder_busy_seconds",
            "time spent in forwards since start",
            ["model", "replica"],
            registry=self.registry,
        )
        self.encoder_forward_seconds = Gauge(
            "whisper_encoder_forward_seconds",
            "of the forwards' time, the part by stage (worker: on the worker thread, the rest being the "
            "hand-over to it and back; gpu_wait: of that, waiting for the kernels, where measured), "
            "summed since start",
            ["model", "replica", "stage"],
            registry=self.registry,
        )
        self.decoder_window_seconds = Gauge(
            "whisper_decoder_window_seconds",
            "decoded windows' time in the decoder by stage (queued: to admission; loading: to the K/V "
            "landing; decoding: to the end), summed since start",
            ["model", "replica", "stage"],
            registry=self.registry,
        )
        self.decoder_load_seconds = Gauge(
            "whisper_decoder_kv_load_stage_seconds",
            "decoded windows' loading stage in parts, summed since start (worker_queue: to a loader worker "
            "starting the pull; pull: the pull and its copy; pickup: to the decode loop seeing it landed)",
            ["model", "replica", "stage"],
            registry=self.registry,
        )
        self.decoder_windows_timed = Gauge(
            "whisper_decoder_windows_timed",
            "decoded windows whose stages whisper_decoder_window_seconds sums",
            ["model", "replica"],
            registry=self.registry,
        )
        self.decoder_steps = Gauge(
            "whisper_decoder_steps",
            "decoder forwards launched since start",
            ["model", "replica"],
            registry=self.registry,
        )
        self.decoder_rows = Gauge(
            "whisper_decoder_rows_stepped",
            "sequences those forwards ran, summed: over whisper_decoder_steps, the mean decode batch",
            ["model", "replica"],
            registry=self.registry,
        )
        self.decoder_read_wait_seconds = Gauge(
            "whisper_decoder_read_wait_seconds",
            "of the loop's time in steps, reading steps' tokens back (mostly waiting for the device)",
            ["model", "replica"],
            registry=self.registry,
        )
        self.decoder_busy_seconds = Gauge(
            "whisper_decoder_loop_busy_seconds",
            "time the decode loop spent in steps since start: over whisper_decoder_steps, the mean step",
            ["model", "replica"],
            registry=self.registry,
        )

        # The diarizer's replicas (deployments/diarizer.py), at each scrape.
        self.diarizer_waiting = Gauge(
            "whisper_diarizer_waiting",
            "calls a diarizer replica holds now, queued for a batch or in one",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_recordings = Gauge(
            "whisper_diarizer_recordings",
            "recordings diarized since start",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_audio_seconds = Gauge(
            "whisper_diarizer_audio_seconds",
            "seconds of audio diarized since start",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_batches = Gauge(
            "whisper_diarizer_batches",
            "diarize batches since start: whisper_diarizer_recordings over it, the mean batch",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_busy_seconds = Gauge(
            "whisper_diarizer_busy_seconds",
            "time spent diarizing batches since start: audio seconds over it, the speed",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_voices = Gauge(
            "whisper_diarizer_voices",
            "voice embeddings since start (live turns' speakers, warm-ups)",
            ["replica"],
            registry=self.registry,
        )
        self.diarizer_own_speech_passes = Gauge(
            "whisper_diarizer_own_speech_passes",
            "recordings whose speech the diarizer found with a Silero pass of its own, since start "
            "(the rest came with the ingress's pass)",
            ["replica"],
            registry=self.registry,
        )

        # Realtime sessions (deployments/http/realtime.py), this ingress replica's own.
        self.decoded_audio_seconds = Gauge(
            "whisper_ingress_decoded_audio_seconds",
            "seconds of decoded audio this ingress replica holds (bounded by http.max_decoded_audio_s)",
            registry=self.registry,
        )
        self.realtime_sessions = Gauge(
            "whisper_realtime_sessions", "open realtime transcription sessions", registry=self.registry
        )
        self.partial_pass_latency = Histogram(
            "whisper_realtime_partial_pass_seconds",
            "a partial pass of a live turn, from its start to its text",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.final_latency = Histogram(
            "whisper_realtime_final_latency_seconds",
            "from the end of a turn (speech_stopped, or the client's commit) to its completed event",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.skipped_partials = Counter(
            "whisper_realtime_partial_passes_skipped",
            "partial passes skipped because the stream's previous pass had not come back (or was still "
            "waiting for one of the replica's partial slots)",
            registry=self.registry,
        )
        self.unchanged_partials = Counter(
            "whisper_realtime_partial_passes_unchanged",
            "partial passes not run because the stream's VAD heard no speech since its last pass "
            "(a pause inside a turn): the text could not change",
            registry=self.registry,
        )

    def observe_partial_pass(self, latency_s: float) -> None:
        self.partial_pass_latency.observe(latency_s)

    def observe_final(self, latency_s: float) -> None:
        self.final_latency.observe(latency_s)

    def observe_request(self, route: str, model: str, status: int, latency_s: float) -> None:
        self.requests.labels(route, model, str(status)).inc()
        self.latency.labels(route, model).observe(latency_s)

    def observe_usage(self, model: str, api_key: str, audio_s: float) -> None:
        """A transcribed request's audio seconds; ``api_key`` is its ``api_key_label``."""
        self.audio_seconds.labels(model, api_key).inc(audio_s)

    def render(
        self, stats_by_model: dict[str, tuple[Sequence, Sequence]], diarizer_stats: Sequence = ()
    ) -> bytes:
        """``stats_by_model``: each model's encoder and decoder replicas' figures; a replica's labels
        are its model and its index among that model's replicas that answered this scrape.
        ``diarizer_stats``: the diarizer replicas' figures (DiarizerStats), labelled by index."""
        for gauge in (
            self.kv_blocks_used,
            self.kv_blocks_free,
            self.decoder_running,
            self.decoder_waiting,
            self.decoder_aborted,
            self.decoder_tokens,
            self.kv_loads,
            self.kv_load_seconds,
            self.encoder_batch_size,
            self.encoder_windows,
            self.encoder_staged,
            self.encoder_precision,
            self.transfer,
            self.encoder_window_seconds,
            self.encoder_busy_seconds,
            self.encoder_forward_seconds,
            self.encoder_batches,
            self.encoder_forwards,
            self.decoder_window_seconds,
            self.decoder_load_seconds,
            self.decoder_windows_timed,
            self.decoder_steps,
            self.decoder_rows,
            self.decoder_busy_seconds,
            self.decoder_read_wait_seconds,
            self.diarizer_waiting,
            self.diarizer_recordings,
            self.diarizer_audio_seconds,
            self.diarizer_batches,
            self.diarizer_busy_seconds,
            self.diarizer_voices,
            self.diarizer_own_speech_passes,
        ):
            gauge.clear()  # replicas come and go; report only the ones that answered this scrape
        for model, (encoder_stats, decoder_stats) in stats_by_model.items():
            for index, stats in enumerate(decoder_stats):
                replica = str(index)
                self.kv_blocks_used.labels(model, replica).set(stats.num_used_blocks)
                self.kv_blocks_free.labels(model, replica).set(stats.num_free_blocks)
                self.decoder_running.labels(model, replica).set(stats.num_running)
                self.decoder_waiting.labels(model, replica).set(stats.num_waiting)
                self.decoder_aborted.labels(model, replica).set(stats.windows_aborted)
                self.decoder_tokens.labels(model, replica).set(stats.tokens_generated)
                self.kv_loads.labels(model, replica).set(stats.kv_loads)
                self.kv_load_seconds.labels(model, replica, "0.5").set(stats.kv_load_p50_s)
                self.kv_load_seconds.labels(model, replica, "0.95").set(stats.kv_load_p95_s)
                timings = stats.timings
                self.decoder_window_seconds.labels(model, replica, "queued").set(timings.queued_s)
                self.decoder_window_seconds.labels(model, replica, "loading").set(timings.loading_s)
                self.decoder_window_seconds.labels(model, replica, "decoding").set(timings.decoding_s)
                self.decoder_load_seconds.labels(model, replica, "worker_queue").set(timings.load_queued_s)
                self.decoder_load_seconds.labels(model, replica, "pull").set(timings.load_pulling_s)
                self.decoder_load_seconds.labels(model, replica, "pickup").set(timings.load_landed_s)
                self.decoder_windows_timed.labels(model, replica).set(timings.windows)
                self.decoder_steps.labels(model, replica).set(timings.steps)
                self.decoder_rows.labels(model, replica).set(timings.rows)
                self.decoder_busy_seconds.labels(model, replica).set(stats.loop_busy_s)
                self.decoder_read_wait_seconds.labels(model, replica).set(timings.read_wait_s)
            for index, stats in enumerate(encoder_stats):
                replica = str(index)
                self.encoder_batch_size.labels(model, replica).set(stats.mean_batch_size)
                self.encoder_windows.labels(model, replica).set(stats.windows_encoded)
                self.encoder_staged.labels(model, replica).set(stats.num_staged)
                self.transfer.labels(model, replica, stats.connector, stats.payload).set(1)
                self.encoder_precision.labels(model, replica, stats.precision).set(1)
                self.encoder_window_seconds.labels(model, replica, "queued").set(stats.queued_s)
                self.encoder_window_seconds.labels(model, replica, "forward").set(stats.window_forward_s)
                self.encoder_busy_seconds.labels(model, replica).set(stats.busy_s)
                self.encoder_forward_seconds.labels(model, replica, "worker").set(stats.worker_s)
                if stats.gpu_wait_s is not None:
                    self.encoder_forward_seconds.labels(model, replica, "gpu_wait").set(stats.gpu_wait_s)
                self.encoder_batches.labels(model, replica).set(stats.batches)
                self.encoder_forwards.labels(model, replica).set(stats.encoder_forwards)
        for index, stats in enumerate(diarizer_stats):
            replica = str(index)
            self.diarizer_waiting.labels(replica).set(stats.waiting)
            self.diarizer_recordings.labels(replica).set(stats.recordings)
            self.diarizer_audio_seconds.labels(replica).set(stats.audio_s)
            self.diarizer_batches.labels(replica).set(stats.batches)
            self.diarizer_busy_seconds.labels(replica).set(stats.busy_s)
            self.diarizer_voices.labels(replica).set(stats.voices)
            self.diarizer_own_speech_passes.labels(replica).set(stats.own_speech_passes)
        return generate_latest(self.registry)
