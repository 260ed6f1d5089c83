"""What the running app says about itself: its Prometheus counters at /metrics, summed over
replicas, and the ingress's Server-Timing header. Tests assert on them; benchmarks/bench_load.py
and benchmarks/bench_realtime.py read them for their figures. The product writes these figures and
never reads them back, so the reader lives here."""

from __future__ import annotations

import re

import httpx


def metric_sum(url: str, prefix: str, headers: dict[str, str] | None = None) -> float:
    """The sum over replicas of one Prometheus metric the app exports at /metrics. ``headers``: an
    app with API keys answers /metrics only with one (``Authorization: Bearer``)."""
    return scrape(url, headers).get(prefix, 0.0)


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as sums over replicas: by metric name, and by name and stage label
    (``name[stage]``)."""
    text = _metrics_text(url, headers)
    sums: dict[str, float] = {}
    for sample in _SAMPLE.finditer(text):
        name, labels, value = sample.groups()
        stage = _STAGE.search(labels or "")
        for key in (name, f"{name}[{stage.group(1)}]" if stage else None):
            if key is not None:
                sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def labelled_sum(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The sum of one metric's samples whose labels include ``labels``, e.g. the audio seconds
    billed to a model: ``labelled_sum(url, "whisper_audio_seconds_total", model="tiny.en")``."""
    text = _metrics_text(url, headers)
    total = 0.0
    for sample in _SAMPLE.finditer(text):
        sample_name, sample_labels, value = sample.groups()
        found = dict(_LABEL.findall(sample_labels or ""))
        if sample_name == name and all(found.get(key) == wanted for key, wanted in labels.items()):
            total += float(value)
    return total


def _metrics_text(url: str, headers: dict[str, str] | None) -> str:
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    response.raise_for_status()  # a 401 is not an empty set of metrics
    return response.text


_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$", re.MULTILINE)  # labels optional
_STAGE = re.compile(r'stage="(\w+)"')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def server_timing_ms(headers) -> dict[str, float]:
    """The phases of a ``Server-Timing`` header (``name;dur=ms, ...``)."""
    phases = {}
    for entry in headers.get("server-timing", "").split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if name and duration:
            phases[name] = float(duration)
    return phases


def steady_figures(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """What the app's counters say about an interval: throughput, the decode batch and step, and
    where a window's time went (means per window, in seconds)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    steps, windows = delta("whisper_decoder_steps"), delta("whisper_decoder_windows_timed")
    encoded = delta("whisper_encoder_windows_encoded")
    return {
        "tokens_per_s": ratio(delta("whisper_decoder_tokens_generated"), seconds),
        "decode_batch": ratio(delta("whisper_decoder_rows_stepped"), steps),
        "step_ms": 1000 * ratio(delta("whisper_decoder_loop_busy_seconds"), steps),
        "read_wait_ms": 1000 * ratio(delta("whisper_decoder_read_wait_seconds"), steps),
        "decoder_busy": ratio(delta("whisper_decoder_loop_busy_seconds"), seconds),
        "encoder_batch": ratio(encoded, delta("whisper_encoder_batches")),
        "encoder_busy": ratio(delta("whisper_encoder_busy_seconds"), seconds),
        "encoder_queued_s": ratio(delta("whisper_encoder_window_seconds[queued]"), encoded),
        "encoder_forward_s": ratio(delta("whisper_encoder_window_seconds[forward]"), encoded),
        "forward_s": ratio(delta("whisper_encoder_busy_seconds"), delta("whisper_encoder_batches")),
        "forward_worker_s": ratio(
            delta("whisper_encoder_forward_seconds[worker]"), delta("whisper_encoder_batches")
        ),
        # Measured by a colocated replica only: absent, it is unknown, not zero.
        "forward_gpu_wait_s": ratio(
            delta("whisper_encoder_forward_seconds[gpu_wait]"), delta("whisper_encoder_batches")
        )
        if "whisper_encoder_forward_seconds[gpu_wait]" in after
        else float("nan"),
        "decoder_queued_s": ratio(delta("whisper_decoder_window_seconds[queued]"), windows),
        "kv_loading_s": ratio(delta("whisper_decoder_window_seconds[loading]"), windows),
        "decoding_s": ratio(delta("whisper_decoder_window_seconds[decoding]"), windows),
        "kv_worker_queue_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[worker_queue]"), windows),
        "kv_pull_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[pull]"), windows),
        "kv_pickup_s": ratio(delta("whisper_decoder_kv_load_stage_seconds[pickup]"), windows),
        "seconds": seconds,
    }
