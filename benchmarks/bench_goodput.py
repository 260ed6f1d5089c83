"""Goodput under an open-loop mixed load: Poisson arrivals at each rate of a sweep, of live streams
(real-time pace over the Realtime WebSocket), short files (interactive) and long files (batch),
each kind judged against its own latency target. Prints, per rate and kind: sent, completed, errors
by status, p50/p95 latency, the target and whether it was met; the goodput (the highest rate at
which every kind met its target); and where the time went at each rate (the app's counters at
/metrics). With --engine-alone it also plays the same file arrivals on the engine in this process
(no app) and prints the app/engine goodput ratio; where the app must be stopped first (one GPU),
--out keeps the app's figures and a second run with --skip-app --app-result reads them. --record
appends the tables to benchmarks/RESULTS.md and writes benchmarks/results/goodput.json.

    python benchmarks/bench_goodput.py --rates 0.5,1,2 --duration-s 120
        [--live-share 0.4 --short-share 0.4 --long-share 0.2] [--short-s 2,15] [--long-s 60,600]
        [--live-target-s 0.5] [--short-target-factor 2] [--fixed-output-tokens N]
        [--engine-alone tiny.en] [--url http://host:8000 --api-key KEY] [--record] [--out run.json]
    python benchmarks/bench_goodput.py --skip-app --engine-alone MODEL --app-result run.json ...

Targets: a live turn's final text (from the end of its audio to its completed event) p95 within
--live-target-s (0.5 s where this machine has a GPU, 1.5 s otherwise); short files p95 within
--short-target-factor times their unloaded p95, measured first in the same run by sending
--unloaded-requests short files one at a time; long files p95 of latency over audio length within
--long-target-factor (1: done within their own length). A request that fails or is never answered
counts as infinitely late, so errors count against the target.

Starts a local Ray and the default model of configs/default.yaml (tiny.en) as a one-model app, as
bench_load.py does, unless --url points at a running one; --fixed-output-tokens needs
``http.benchmark_fields: true`` there (the app started here has it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_load import start_default_app  # noqa: E402
from benchmarks.goodput_traffic import LIVE, LONG, SHORT, AppClient, Lengths, MixAudio, play, send_to_app  # noqa: E402
from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from tests.support.app_metrics import scrape, steady_figures  # noqa: E402
from tests.support.mixed_load import (  # noqa: E402
    Arrival,
    KindSummary,
    Target,
    all_met,
    goodput,
    percentile,
    poisson_arrivals,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_HEADERS = [
    "rate /s",
    "kind",
    "sent",
    "completed",
    "errors",
    "p50 s",
    "p95 s",
    "target",
    "judged p95",
    "met",
]
TIME_HEADERS = [
    "rate /s",
    "tokens/s",
    "decode batch / step ms",
    "decoder busy / encoder busy",
    "encoder batch",
    "a window's ms: encoder queue, forward; decoder queue, K/V load, decoding",
]


def _pair(text: str) -> tuple[float, float]:
    low, high = (float(part) for part in text.split(","))
    return low, high


def unloaded_short_arrivals(count: int, seed: int) -> list[Arrival]:
    """Short files one after another (each sent once the last is answered: ``at_s`` 0 and played one
    at a time), the reference for the short files' target."""
    return [Arrival(0.0, SHORT, seed * 7919 + index) for index in range(count)]


def measure_unloaded_p95_s(send, arrivals: list[Arrival]) -> float:
    latencies = []
    for arrival in arrivals:
        outcome = send(arrival)
        if outcome.status != "ok":
            raise RuntimeError(f"an unloaded short file failed ({outcome.status}): no reference latency")
        latencies += outcome.latencies_s
    return percentile(latencies, 0.95)


def summary_rows(rate: float, summaries: list[KindSummary]) -> list[list]:
    met = {None: "n/a", True: "yes", False: "no"}
    return [
        [
            rate,
            s.kind,
            s.sent,
            s.completed,
            s.errors or "-",
            round(s.p50_s, 3),
            round(s.p95_s, 3),
            s.target.describe(),
            round(s.target_figure_p95, 3),
            met[s.met],
        ]
        for s in summaries
    ]


def time_row(rate: float, figures: dict[str, float]) -> list:
    ms = {key: round(1000 * figures[key], 1) for key in figures if key.endswith("_s") and key != "seconds"}
    return [
        rate,
        round(figures["tokens_per_s"], 1),
        f"{figures['decode_batch']:.1f} / {figures['step_ms']:.2f}",
        f"{figures['decoder_busy']:.0%} / {figures['encoder_busy']:.0%}",
        round(figures["encoder_batch"], 2),
        f"{ms['encoder_queued_s']}, {ms['encoder_forward_s']}; {ms['decoder_queued_s']}, "
        f"{ms['kv_loading_s']}, {ms['decoding_s']}",
    ]


def sweep(rates, play_rate, targets: dict[str, Target], kinds: list[str]) -> dict[float, list[KindSummary]]:
    """Each rate's schedule played in turn (``play_rate(rate)``: its outcomes), every request answered
    or failed before the next rate starts; each rate's table printed as it ends."""
    results = {}
    for rate in rates:
        outcomes = play_rate(rate)
        results[rate] = [summarize(kind, outcomes, targets[kind]) for kind in kinds]
        print(markdown_table(SUMMARY_HEADERS, summary_rows(rate, results[rate])), flush=True)
    return results


def file_goodput(results: dict[float, list[KindSummary]]) -> float | None:
    """Goodput judged on the file kinds alone: what the engine alone can be set against."""
    return goodput(
        {rate: all_met([s for s in summaries if s.kind != LIVE]) for rate, summaries in results.items()}
    )


def summary_dict(summary: KindSummary) -> dict:
    return {
        "kind": summary.kind,
        "sent": summary.sent,
        "completed": summary.completed,
        "errors": summary.errors,
        "p50_s": summary.p50_s,
        "p95_s": summary.p95_s,
        "target": summary.target.describe(),
        "judged_p95": summary.target_figure_p95,
        "met": summary.met,
    }


def run_app(args, rates, schedules, audio, kinds, live_target_s) -> tuple[list[tuple[str, str]], dict]:
    """The sweep against the app: its tables and its figures for the JSON record."""
    fields = {"fixed_output_tokens": str(args.fixed_output_tokens)} if args.fixed_output_tokens else {}
    url = args.url or start_default_app(benchmark_fields=bool(args.fixed_output_tokens))
    app = AppClient(url, args.api_key, fields, args.request_timeout_s)
    send = send_to_app(app, audio)
    # Warm-up: the first request of each kind pays for lazy start-up work.
    for kind in kinds:
        send(Arrival(0.0, kind, -1))
    unloaded_s = measure_unloaded_p95_s(send, unloaded_short_arrivals(args.unloaded_requests, args.seed))
    print(f"short files unloaded p95: {unloaded_s:.3f} s", flush=True)
    targets = {
        LIVE: Target(live_target_s),
        SHORT: Target(args.short_target_factor * unloaded_s),
        LONG: Target(args.long_target_factor, per_audio_s=True),
    }
    time_rows = []

    def play_rate(rate: float) -> list:
        began, before = time.monotonic(), scrape(url, app.headers)
        outcomes = play(schedules[rate], send)
        figures = steady_figures(before, scrape(url, app.headers), time.monotonic() - began)
        time_rows.append(time_row(rate, figures))
        return outcomes

    results = sweep(rates, play_rate, targets, kinds)
    every_kind = goodput({rate: all_met(summaries) for rate, summaries in results.items()})
    files_only = file_goodput(results)
    rows = [row for rate in rates for row in summary_rows(rate, results[rate])]
    figures = [
        ["short files' unloaded p95 s", round(unloaded_s, 3)],
        ["goodput, every kind on target (arrivals /s)", every_kind or "none met"],
        ["goodput, file kinds on target (arrivals /s)", files_only or "none met"],
    ]
    tables = [
        ("The app: per rate and kind", markdown_table(SUMMARY_HEADERS, rows)),
        (
            "Where the time went (the app's counters over each rate's run)",
            markdown_table(TIME_HEADERS, time_rows),
        ),
        ("Goodput", markdown_table(["figure", "value"], figures)),
    ]
    metrics = {
        "unloaded_short_p95_s": unloaded_s,
        "goodput_per_s": every_kind,
        "file_goodput_per_s": files_only,
        "by_rate": {str(rate): [summary_dict(s) for s in results[rate]] for rate in rates},
    }
    return tables, metrics


def run_engine_alone(args, rates, schedules, audio, kinds, app_metrics) -> tuple[list[tuple[str, str]], dict]:
    """The file arrivals of every rate on the engine in this process: its goodput is the ceiling
    the app's file goodput is set against."""
    from benchmarks.engine_open_loop import play_on_engine
    from engine.config import EngineConfig
    from engine.transcribe.offline import Transcriber
    from engine.types import DecodeOptions, FallbackOptions

    # As the app decodes: temperature fallback on (OpenAI's default), or exactly N tokens a window.
    options = (
        DecodeOptions(max_tokens=args.fixed_output_tokens, ignore_eot=True)
        if args.fixed_output_tokens
        else DecodeOptions(fallback=FallbackOptions())
    )
    settings = json.loads(args.engine_settings)  # as the app's engine section sets them (its sizes)
    with Transcriber(EngineConfig(model=args.engine_alone, **settings)) as transcriber:
        play_on_engine(transcriber, [Arrival(0.0, SHORT, -1)], audio, options)  # warm-up
        unloaded = [
            latency
            for arrival in unloaded_short_arrivals(args.unloaded_requests, args.seed)
            for latency in play_on_engine(transcriber, [arrival], audio, options)[0].latencies_s
        ]
        unloaded_s = percentile(unloaded, 0.95)
        targets = {
            SHORT: Target(args.short_target_factor * unloaded_s),
            LONG: Target(args.long_target_factor, per_audio_s=True),
        }
        file_kinds = [kind for kind in kinds if kind != LIVE]
        results = sweep(
            rates,
            lambda rate: play_on_engine(transcriber, schedules[rate], audio, options),
            targets,
            file_kinds,
        )
    engine_goodput = file_goodput(results)
    app_file_goodput = (app_metrics or {}).get("file_goodput_per_s")
    ratio = app_file_goodput / engine_goodput if app_file_goodput and engine_goodput else None
    rows = [row for rate in rates for row in summary_rows(rate, results[rate])]
    figures = [
        ["engine's short files unloaded p95 s", round(unloaded_s, 3)],
        ["engine goodput, file kinds on target (arrivals /s)", engine_goodput or "none met"],
        ["app / engine goodput, file kinds", round(ratio, 3) if ratio else "n/a"],
    ]
    tables = [
        (
            f"The engine alone ({args.engine_alone}), the same file arrivals",
            markdown_table(SUMMARY_HEADERS, rows),
        ),
        ("The app against the engine alone", markdown_table(["figure", "value"], figures)),
    ]
    metrics = {
        "model": args.engine_alone,
        "unloaded_short_p95_s": unloaded_s,
        "file_goodput_per_s": engine_goodput,
        "app_over_engine": ratio,
        "by_rate": {str(rate): [summary_dict(s) for s in results[rate]] for rate in rates},
    }
    return tables, metrics


def main() -> None:
    args = parse_args()
    import torch

    rates = [float(rate) for rate in args.rates.split(",")]
    shares = {LIVE: args.live_share, SHORT: args.short_share, LONG: args.long_share}
    kinds = [kind for kind, share in shares.items() if share > 0]
    # One schedule per rate, the same for the app and the engine alone.
    schedules = {
        rate: poisson_arrivals(rate, args.duration_s, shares, args.seed * 1000 + index)
        for index, rate in enumerate(rates)
    }
    audio = MixAudio(Lengths(args.short_s, args.long_s, args.live_turns))
    live_target_s = args.live_target_s or (0.5 if torch.cuda.is_available() else 1.5)
    tables, metrics = [], {"rates": rates, "shares": shares, "duration_s": args.duration_s}
    if not args.skip_app:
        app_tables, metrics["app"] = run_app(args, rates, schedules, audio, kinds, live_target_s)
        tables += app_tables
        for title, table in app_tables:
            print(f"\n### {title}\n\n{table}", flush=True)
    if args.app_result:
        metrics["app"] = json.loads(Path(args.app_result).read_text())["app"]
    if args.engine_alone:
        engine_tables, metrics["engine"] = run_engine_alone(
            args, rates, schedules, audio, kinds, metrics.get("app")
        )
        tables += engine_tables
        for title, table in engine_tables:
            print(f"\n### {title}\n\n{table}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=1))
    if args.record:
        record(
            "Goodput under an open-loop mixed load (bench_goodput.py)",
            titled_tables(tables),
            f"Poisson arrivals for {args.duration_s:g} s at each rate; shares {shares}; short files "
            f"{args.short_s[0]:g}-{args.short_s[1]:g} s, long {args.long_s[0]:g}-{args.long_s[1]:g} s, "
            f"live streams of {args.live_turns} utterances.",
            json_path=ROOT / "benchmarks" / "results" / "goodput.json",
            metrics=metrics,
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running app; default: start configs/default.yaml here")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rates", default="0.5,1,2", help="total arrivals per second, one run each")
    parser.add_argument("--duration-s", type=float, default=120, help="how long arrivals come at each rate")
    parser.add_argument("--live-share", type=float, default=0.4)
    parser.add_argument("--short-share", type=float, default=0.4)
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--short-s", type=_pair, default=(2.0, 15.0), help="short files' length range, s")
    parser.add_argument("--long-s", type=_pair, default=(60.0, 600.0), help="long files' length range, s")
    parser.add_argument("--live-turns", type=int, default=3, help="utterances of each live stream")
    parser.add_argument("--live-target-s", type=float, default=None, help="default: 0.5 on a GPU, 1.5 on CPU")
    parser.add_argument("--short-target-factor", type=float, default=2.0)
    parser.add_argument("--long-target-factor", type=float, default=1.0)
    parser.add_argument("--unloaded-requests", type=int, default=8)
    parser.add_argument("--fixed-output-tokens", type=int, default=None, help="every window decodes N tokens")
    parser.add_argument("--request-timeout-s", type=float, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-alone", metavar="MODEL", help="also play the file arrivals on this model's engine here"
    )
    parser.add_argument(
        "--engine-settings", default="{}", help="JSON: the engine-alone EngineConfig's other fields"
    )
    parser.add_argument("--skip-app", action="store_true", help="with --engine-alone: the engine only")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument(
        "--app-result", help="with --skip-app: an earlier run's --out, for the app/engine ratio"
    )
    args = parser.parse_args()
    if args.skip_app and not args.engine_alone:
        parser.error("--skip-app leaves nothing to measure without --engine-alone MODEL")
    return args


if __name__ == "__main__":
    main()
