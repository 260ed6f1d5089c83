"""Load test of the serving app: many concurrent clients for minutes; every request must get a
final answer, no 5xx but the designed 429/503, every process's memory flat after warm-up, and
the KV pool all free at the end. Prints the figures (requests, statuses, throughput, latency
percentiles, tokens/s, where a window's time went), each process's memory and busy cores; --record
appends them to the results log (benchmarks/recording.py) and writes benchmarks/results/load.json.

    .venv/bin/python benchmarks/bench_load.py [--clients 64] [--processes 1] [--duration-s 300] [--record]
        [--fixed-output-tokens N] [--no-fallback] [--priority interactive|batch]

Starts a local Ray and the default model of configs/default.yaml (tiny.en) as a one-model app unless
--url points at a running one.
The vendor fields let random weights be measured: ``--fixed-output-tokens`` makes every window
decode exactly N tokens (the server's benchmark-only ``fixed_output_tokens``, which a server accepts
only with ``http.benchmark_fields: true``: the app started here has it on; a server at --url needs
it in its config). Tokens/s comes from the decoders' own counters
(``whisper_decoder_tokens_generated`` at /metrics).
"""

from __future__ import annotations

import argparse
import atexit
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from tests.support.load import LoadReport, run_load  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.serving import default_app_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def steady_rows(steady: dict[str, float]) -> list[list]:
    """The table rows of steady_figures(): what the app's counters saw between warm-up and stop."""
    if not steady:
        return []
    ms = {key: round(1000 * steady[key], 1) for key in steady if key.endswith("_s") and key != "seconds"}
    return [
        ["steady s (warm-up end to stop)", round(steady["seconds"], 1)],
        ["steady tokens/s (decoder counters)", round(steady["tokens_per_s"], 1)],
        [
            "steady decode batch (rows a step) / step ms (of it, reading tokens back)",
            f"{steady['decode_batch']:.1f} / {steady['step_ms']:.2f} ({steady['read_wait_ms']:.2f})",
        ],
        [
            "steady decode loop busy / encoder busy",
            f"{steady['decoder_busy']:.0%} / {steady['encoder_busy']:.0%}",
        ],
        ["steady encoder batch", round(steady["encoder_batch"], 2)],
        [
            "a window's ms: encoder queue, forward; decoder queue, K/V load, decoding",
            f"{ms['encoder_queued_s']}, {ms['encoder_forward_s']}; {ms['decoder_queued_s']}, "
            f"{ms['kv_loading_s']}, {ms['decoding_s']}",
        ],
        [
            "of the K/V load, ms: waiting for a loader worker, pulling, waiting for the loop",
            f"{ms['kv_worker_queue_s']}, {ms['kv_pull_s']}, {ms['kv_pickup_s']}",
        ],
        [
            "a forward's ms: all, on its worker thread, of that waiting for the GPU (colocated)",
            f"{ms['forward_s']}, {ms['forward_worker_s']}, {ms['forward_gpu_wait_s']}",
        ],
    ]


def server_phase_rows(report: LoadReport) -> list[list]:
    """Mean ms of each ingress phase, and of the rest of a request's latency as its client saw it
    (the HTTP proxy, the network, the client itself)."""
    answered = len(report.transcribed)
    if not answered or not report.server_phases_ms:
        return []
    means = {phase: total / answered for phase, total in report.server_phases_ms.items()}
    outside = 1000 * sum(report.latencies_s()) / answered - sum(means.values())
    return [
        [
            "a request's mean ms in the ingress: " + ", ".join(means),
            ", ".join(f"{ms:.1f}" for ms in means.values()),
        ],
        ["a request's mean ms outside the ingress (proxy, network, client)", round(outside, 1)],
    ]


def start_default_app(cpu_dtype: str | None = None, benchmark_fields: bool = False) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    args = default_app_args()
    if cpu_dtype:
        args["engine"]["cpu_dtype"] = cpu_dtype
    if benchmark_fields:  # the server accepts the benchmark-only request fields
        args["http"] = {**args.get("http", {}), "benchmark_fields": True}
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    # Before Ray's own shutdown at exit (registered earlier, so it runs later): Serve stops what it
    # started outside Ray's workers, such as HAProxy (README, "Behind HAProxy").
    atexit.register(serve.shutdown)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="whisper", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running server; default: start configs/default.yaml here")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="spread the clients over this many processes (a server's clients are not one interpreter)",
    )
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--warmup-s", type=float, default=30)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--fixed-output-tokens", type=int, default=None, help="every window decodes N tokens")
    parser.add_argument("--no-fallback", action="store_true", help="send temperature_fallback=false")
    parser.add_argument("--priority", choices=["interactive", "batch"], default=None)
    parser.add_argument(
        "--cpu-dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="engine.cpu_dtype of the app",
    )
    args = parser.parse_args()
    fields = {}
    if args.fixed_output_tokens:
        fields["fixed_output_tokens"] = str(args.fixed_output_tokens)
    if args.no_fallback:
        fields["temperature_fallback"] = "false"
    if args.priority:
        fields["priority"] = args.priority
    url = args.url or start_default_app(args.cpu_dtype, benchmark_fields=bool(args.fixed_output_tokens))
    report = run_load(
        url,
        args.clients,
        args.duration_s,
        args.warmup_s,
        args.api_key,
        fields=fields,
        processes=args.processes,
    )
    rows = [
        ["clients", report.clients],
        ["load-generating processes", args.processes],
        ["duration s", report.duration_s],
        ["requests sent", report.sent],
        ["answered", report.answered],
        ["lost (no answer)", len(report.lost)],
        ["statuses", dict(sorted(report.statuses.items()))],
        ["unexpected 5xx", report.unexpected_5xx],
        ["audio s transcribed", round(report.audio_s, 1)],
        ["wall s (to the last answer)", round(report.wall_s, 1)],
        ["throughput (audio s / wall s)", round(report.audio_s / report.wall_s, 2)],
        ["latency mean s", round(sum(report.latencies_s()) / max(1, len(report.transcribed)), 3)],
        ["latency p50 s", round(report.percentile_s(0.5), 2)],
        ["latency p95 s", round(report.percentile_s(0.95), 2)],
        ["latency p50 s, clips over 30 s", round(report.percentile_s(0.5, "long"), 2)],
        [
            "latency p50 / p95 s, clips up to 30 s",
            " / ".join(str(round(report.percentile_s(q, "short"), 2)) for q in (0.5, 0.95)),
        ],
        ["tokens decoded / wall s (decoder counters)", round(report.tokens_per_s, 1)],
        *steady_rows(report.steady),
        *server_phase_rows(report),
        ["vendor fields", fields or "none"],
        ["engine.cpu_dtype", args.cpu_dtype or ("the server's" if args.url else "default (auto)")],
        ["max RSS growth after warm-up", f"{report.max_rss_growth:.1%}"],
        ["KV blocks used at end", report.kv_blocks_used_at_end],
        ["staged K/V at end", report.staged_at_end],
    ]
    rss_rows = [
        [name, round(s[0]), round(s[-1]), f"{(s[-1] - s[0]) / s[0]:.1%}"]
        for name, s in report.rss_mb.items()
        if s
    ]
    cpu_rows = [[name, f"{cores:.2f}"] for name, cores in sorted(report.cpu_cores.items())]
    table = (
        markdown_table(["figure", "value"], rows)
        + "\n\n"
        + markdown_table(["process", "RSS MB after warm-up", "RSS MB at end", "growth"], rss_rows)
        + "\n\n"
        + markdown_table(["process", "cores busy over the steady part"], cpu_rows)
    )
    print(table)
    if report.lost:
        print("lost:", report.lost[:10])
    if args.record:
        metrics = {
            "clients": report.clients,
            "duration_s": report.duration_s,
            "sent": report.sent,
            "answered": report.answered,
            "lost_requests": len(report.lost),
            "unexpected_5xx": report.unexpected_5xx,
            "statuses": {str(k): v for k, v in report.statuses.items()},
            "max_rss_growth": report.max_rss_growth,
            "latency_p50_s": report.percentile_s(0.5),
            "latency_p95_s": report.percentile_s(0.95),
            "latency_p95_s_clips_up_to_30_s": report.percentile_s(0.95, "short"),
            "kv_blocks_used_at_end": report.kv_blocks_used_at_end,
            "staged_at_end": report.staged_at_end,
            "tokens_per_s": report.tokens_per_s,
            "steady": report.steady,
        }
        record(
            "Load test, default app on CPU (bench_load.py)",
            table,
            "Clients loop over the 42 English clips of the speech set, one request at a time each.",
            json_path=ROOT / "benchmarks" / "results" / "load.json",
            metrics=metrics,
        )


if __name__ == "__main__":
    main()
