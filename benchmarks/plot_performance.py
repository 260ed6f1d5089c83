"""docs/performance.md and its plots, from the recorded results in benchmarks/results/*.json.

    python benchmarks/plot_performance.py    (or: make docs)

Each section of the page names the machine, the date and the command its figures came from, as
recorded beside them in the JSON. It prints nothing: what it makes is the page and its plots. The
page is written whole, so a new result means a new JSON file (or a changed one) and a rerun of this
script; tests/test_docs.py checks the committed page is what this script writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DOCS_DIR = REPO_ROOT / "docs"
REGENERATE = "python benchmarks/plot_performance.py"

OURS = "#1f77b4"
PEER = "#ff7f0e"
BOUND = "#7f7f7f"
SHAPES = (("large-v3", ""), ("large-v3-turbo", "turbo_"))
BATCHES = (1, 16, 64, 128)


def load(results_dir: Path, name: str) -> dict:
    return json.loads((results_dir / f"{name}.json").read_text())


def provenance(record: dict) -> list[str]:
    machine = record.get("machine") or record.get("device")
    lines = [f"- machine: {machine}", f"- date: {record['date']}", f"- command: `{record['command']}`"]
    load = record.get("load") or record.get("metrics", {}).get("load")
    if load:
        lines.append(f"- load: {load}")
    if "note" in record:
        lines.append(f"- note: {record['note']}")
    if "source" in record:
        lines.append(f"- recorded from: {record['source']}")
    return lines + [""]


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def save(figure, images_dir: Path, name: str) -> str:
    figure.tight_layout()
    figure.savefig(images_dir / name, dpi=110)
    plt.close(figure)
    return f"![{name}](images/{name})"


def bar_labels(axis, bars, fmt: str = "{:.0f}") -> None:
    for bar in bars:
        axis.annotate(
            fmt.format(bar.get_height()),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )


def gpu_engine(results_dir: Path, images_dir: Path) -> list[str]:
    record = load(results_dir, "gpu")
    m = record["metrics"]
    lines = ["## The engine against transformers on one GPU", ""]
    lines += [
        "Random weights of each shape, every request decoding 100 tokens; transformers runs the same "
        "requests in static batches. The engine alone, without Ray Serve (the served app: below).",
        "",
    ]
    lines += provenance(record)
    variants = [
        ("transformers", "hf_engine_req_per_s"),
        ("ours, fp16", "engine_req_per_s"),
        ("ours, fp8 KV cache", "fp8kv_engine_req_per_s"),
        ("ours, FP8 encoder", "fp8enc_engine_req_per_s"),
        ("ours, FP8 encoder + fp8 KV cache", "fp8enc_fp8kv_engine_req_per_s"),
    ]
    rows = []
    for label, key in variants:
        row = [label]
        for _, prefix in SHAPES:
            value = m.get(prefix + key)
            # The ratio as recorded: against the transformers run of the same call.
            ratio = m.get(prefix + key.replace("req_per_s", "speedup_vs_hf"), 1.0)
            row.append("-" if value is None else f"{value:.1f} ({ratio:.2f}x)")
        rows.append(row)
    lines += [
        "**Requests a second on a stream of 1024 requests** (x: against transformers in the same run)",
        "",
    ]
    lines += table(["engine", "large-v3", "large-v3-turbo"], rows)

    figure, axis = plt.subplots(figsize=(8, 3.8))
    width = 0.16
    for index, (label, key) in enumerate(variants):
        values = [m.get(prefix + key, 0.0) for _, prefix in SHAPES]
        color = PEER if label == "transformers" else plt.cm.Blues(0.45 + 0.13 * index)
        bars = axis.bar([x + (index - 2) * width for x in range(2)], values, width, label=label, color=color)
        bar_labels(axis, [bar for bar in bars if bar.get_height() > 0])
    axis.set_xticks(range(2), [shape for shape, _ in SHAPES])
    axis.set_ylabel("requests / s")
    axis.set_title(f"Engine throughput, {record['machine'].split(',')[0]} ({record['date']})")
    axis.legend(fontsize=8, loc="upper left")
    lines += [save(figure, images_dir, "engine_throughput.png"), ""]

    lines += ["**Decode step, ms** (bound: the step's bytes at the GPU's memory bandwidth)", ""]
    rows = []
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for axis, (shape, prefix) in zip(axes, SHAPES):
        ours = [m[f"{prefix}decode_ms_per_step_bs{b}"] for b in BATCHES]
        bound = [m[f"{prefix}decode_ms_per_step_bs{b}_bound"] for b in BATCHES]
        hf = [m[f"{prefix}hf_decode_ms_per_step_bs{b}"] for b in BATCHES]
        for batch, o, b, h in zip(BATCHES, ours, bound, hf):
            rows.append([shape, batch, f"{o:.2f}", f"{b:.2f} ({o / b:.1f}x)", f"{h:.1f} ({h / o:.1f}x)"])
        axis.plot(BATCHES, hf, "o-", color=PEER, label="transformers")
        axis.plot(BATCHES, ours, "o-", color=OURS, label="ours")
        axis.plot(BATCHES, bound, "o--", color=BOUND, label="memory-bandwidth bound")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(BATCHES, [str(b) for b in BATCHES])
        axis.set_xlabel("windows in the step")
        axis.set_ylabel("ms a step")
        axis.set_title(shape)
    axes[0].legend(fontsize=8)
    lines += table(["shape", "batch", "ours", "bound (ours / bound)", "transformers (/ ours)"], rows)
    lines += [save(figure, images_dir, "decode_step.png"), ""]

    rows = []
    for shape, prefix in SHAPES:
        fp16 = m[f"{prefix}encoder_windows_per_s_bs64"]
        fp8 = m[f"{prefix}fp8enc_encoder_windows_per_s_bs64"]
        hf = m[f"{prefix}hf_encoder_windows_per_s_bs64"]
        rows.append([shape, f"{fp16:.0f} ({fp16 / hf:.2f}x)", f"{fp8:.0f} ({fp8 / hf:.2f}x)", f"{hf:.0f}"])
    lines += ["**Encoder, 30 s windows a second at batch 64**", ""]
    lines += table(["shape", "ours, fp16", "ours, FP8 encoder", "transformers"], rows)
    rows = [
        [
            shape,
            f"{m[prefix + 'light_load_p50_latency_s']:.2f} s",
            f"{m[prefix + 'hf_light_load_p50_latency_s']:.1f} s",
        ]
        for shape, prefix in SHAPES
    ]
    lines += ["**Median latency under a light load** (a Poisson stream at 15 requests a second)", ""]
    lines += table(["shape", "ours", "transformers"], rows)
    return lines


def offline_cpu(results_dir: Path, images_dir: Path) -> list[str]:
    record = load(results_dir, "offline_cpu")
    lines = ["## The engine against faster-whisper on a CPU", ""]
    lines += provenance(record)
    rows = record["metrics"]["rows"]
    int8 = {row["in_flight"]: row["rtfx"] for row in rows if row["system"] == "faster-whisper int8"}
    lines += table(
        [
            "system",
            "in flight",
            "start-up s",
            "wall s",
            "RTFx (audio s / wall s)",
            "/ faster-whisper int8",
            "WER",
        ],
        [
            [
                r["system"],
                r["in_flight"],
                r.get("startup_s", ""),
                r["wall_s"],
                r["rtfx"],
                f"{r['rtfx'] / int8[r['in_flight']]:.2f}x",
                f"{r['wer']:.1%}",
            ]
            for r in rows
        ],
    )
    systems = list(dict.fromkeys(row["system"] for row in rows))
    figure, axis = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(systems)
    for index, system in enumerate(systems):
        values = [
            next(r["rtfx"] for r in rows if r["system"] == system and r["in_flight"] == n) for n in (1, 16)
        ]
        color = (PEER if "int8" in system else "#ffbb78") if "faster" in system else None
        color = color or (
            OURS if system.endswith("bfloat16)") else "#6baed6" if "bfloat16" in system else "#aec7e8"
        )
        offset = (index - (len(systems) - 1) / 2) * width
        bars = axis.bar([x + offset for x in range(2)], values, width, label=system, color=color)
        bar_labels(axis, bars, "{:.1f}")
    axis.set_xticks(range(2), ["one request at a time", "16 in flight"])
    axis.set_ylabel("RTFx (audio s / wall s)")
    axis.set_title(f"tiny.en on 2 CPU cores ({record['date']})")
    axis.margins(y=0.3)
    axis.legend(fontsize=8, loc="upper left")
    return lines + [save(figure, images_dir, "offline_cpu.png"), ""]


def app_vs_engine(results_dir: Path, images_dir: Path) -> list[str]:
    record = load(results_dir, "app_vs_engine_one_gpu")
    lines = ["## The served app against its engine on one GPU", ""]
    lines += [
        "The whole app (HTTP, Ray Serve, encoder, K/V hand-over, decoder) against the engine alone on the "
        "same machine, each fed by the same number of closed-loop clients. Layouts: colocated (one replica "
        "encodes and decodes, `configs/<shape>-one-gpu.yaml`) and disaggregated under CUDA MPS (an "
        "encoder and a decoder replica sharing the GPU, `configs/large-v3-turbo-one-gpu-mps.yaml`). "
        "Each row is one run.",
        "",
    ]
    lines += provenance(record)
    runs = record["runs"]
    lines += table(
        ["shape", "layout", "clients", "tokens/s", "engine alone", "app / engine", "p50 / p95 s"],
        [
            [
                r["shape"],
                r["layout"],
                r["clients"],
                f"{r['steady_tokens_per_s']:,}",
                f"{r['engine_alone_tokens_per_s']:,}",
                f"{r['steady_tokens_per_s'] / r['engine_alone_tokens_per_s']:.2f}x",
                f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f}",
            ]
            for r in runs
        ],
    )
    groups = list(dict.fromkeys((r["shape"], r["clients"]) for r in runs))
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    figure, axis = plt.subplots(figsize=(8, 3.6))
    for index, (shape, clients) in enumerate(groups):
        for offset, layout in enumerate(layouts):
            ratios = [
                r["steady_tokens_per_s"] / r["engine_alone_tokens_per_s"]
                for r in runs
                if (r["shape"], r["clients"], r["layout"]) == (shape, clients, layout)
            ]
            x = index + (offset - 0.5) * 0.3
            axis.bar(
                x,
                sum(ratios) / len(ratios),
                0.28,
                color=OURS if offset else "#aec7e8",
                label=layout if index == 0 else None,
            )
            axis.plot([x] * len(ratios), ratios, "k.", markersize=6)
    axis.axhline(1.0, color=BOUND, linestyle="--", linewidth=1)
    axis.set_xticks(range(len(groups)), [f"{shape}\n{clients} clients" for shape, clients in groups])
    axis.set_ylim(0, 1.1)
    axis.set_ylabel("app tokens/s / engine alone's")
    axis.set_title(f"The served app against its engine, one H200 ({record['date']}); dots: runs")
    axis.legend(fontsize=8, loc="lower right")
    return lines + [save(figure, images_dir, "app_vs_engine.png"), ""]


def realtime(results_dir: Path, images_dir: Path) -> list[str]:
    cpu = load(results_dir, "realtime_cpu")
    gpu = load(results_dir, "realtime_gpu")
    lines = ["## Live streams (`/v1/realtime`)", ""]
    lines += [
        "Final latency: from the end of an utterance's audio to its completed text. On a CPU against a "
        "whisper_streaming-style loop over faster-whisper; on a GPU with the large-v3-turbo shape.",
        "",
        "**tiny.en on a CPU**",
        "",
    ]
    lines += provenance(cpu)
    lines += table(
        ["system", "streams", "final p50 s", "final p95 s", "live text / file endpoint's, WER"],
        [
            [
                r["system"],
                r["streams"],
                r["final_p50_s"],
                r["final_p95_s"],
                f"{r['wer_vs_file_endpoint']:.1%}",
            ]
            for r in cpu["rows"]
        ],
    )
    lines += ["**large-v3-turbo shape on one GPU**", ""]
    lines += provenance(gpu)
    lines += table(
        ["streams", "final p50 s", "final p95 s"],
        [[r["streams"], r["final_p50_s"], r["final_p95_s"]] for r in gpu["rows"]],
    )
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for system in dict.fromkeys(r["system"] for r in cpu["rows"]):
        rows = [r for r in cpu["rows"] if r["system"] == system]
        color = OURS if system.startswith("whisper-disagg") else PEER
        axes[0].plot(
            [r["streams"] for r in rows], [r["final_p95_s"] for r in rows], "o-", color=color, label=system
        )
    axes[0].set_title(f"tiny.en, 2 CPU cores ({cpu['date']})")
    axes[1].plot(
        [r["streams"] for r in gpu["rows"]],
        [r["final_p95_s"] for r in gpu["rows"]],
        "o-",
        color=OURS,
        label="whisper-disagg /v1/realtime",
    )
    axes[1].set_title(f"large-v3-turbo shape, one H100 ({gpu['date']})")
    for axis, record in zip(axes, (cpu, gpu)):
        streams = sorted({r["streams"] for r in record["rows"]})
        axis.set_xscale("log", base=2)
        axis.set_xticks(streams, [str(n) for n in streams])
        axis.set_xlabel("live streams")
        axis.set_ylabel("final latency p95, s")
        axis.axhline(1.0, color=BOUND, linestyle="--", linewidth=1)
        axis.legend(fontsize=8, loc="upper left")
    return lines + [save(figure, images_dir, "realtime.png"), ""]


def multi_gpu(results_dir: Path, images_dir: Path) -> list[str]:
    record = load(results_dir, "multi_gpu")
    lines = ["## Two GPUs: colocated replicas or an encoder GPU and a decoder GPU", ""]
    lines += provenance(record)
    runs = record["runs"]
    lines += table(
        ["shape", "layout", "tokens/s", "audio s / s", "p50 / p95 s", "lost", "K/V pull p50 ms"],
        [
            [
                r["shape"],
                r["layout"],
                f"{r['steady_tokens_per_s']:,}",
                r["audio_s_per_wall_s"],
                f"{r['latency_p50_s']} / {r['latency_p95_s']}",
                r["lost"],
                r["kv_pull_p50_ms"] or "-",
            ]
            for r in runs
        ],
    )
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    figure, axis = plt.subplots(figsize=(7, 3.4))
    for index, shape in enumerate(shapes):
        for offset, run in enumerate(r for r in runs if r["shape"] == shape):
            colocated = run["layout"].startswith("colocated")
            bars = axis.bar(
                index + (offset - 0.5) * 0.35,
                run["steady_tokens_per_s"],
                0.33,
                color=OURS if colocated else "#aec7e8",
                label=("colocated x2" if colocated else "encoder GPU + decoder GPU") if index == 0 else None,
            )
            bar_labels(axis, bars, "{:,.0f}")
    axis.set_xticks(range(len(shapes)), shapes)
    axis.set_ylabel("tokens / s")
    axis.set_title(f"Two H200s, 128 clients ({record['date']})")
    axis.legend(fontsize=8)
    return lines + [save(figure, images_dir, "multi_gpu.png"), ""]


GOODPUT_LAYOUTS = (("large-v3-turbo", "goodput_gpu_layouts"), ("large-v3", "goodput_gpu_layouts_large-v3"))
GOODPUT_MIXES = ("default", "live-heavy")


def goodput_one_gpu(results_dir: Path, images_dir: Path) -> list[str]:
    """Each shape's one-GPU layouts under the open-loop mixed load: the highest arrival rate at
    which every kind met its target, the planner's prediction beside it."""
    lines = ["## Goodput on one GPU by layout: live streams and files arriving at random", ""]
    lines += [
        "Live streams, short files (2-15 s, interactive) and long files (1-10 min, batch) arrive as a "
        "Poisson process; goodput is the highest rate at which every kind met its target (live final "
        "p95 <= 0.5 s, short files p95 <= twice their unloaded p95, long files done within their "
        "audio's length). Default mix 40% live, 40% short, 20% long; live-heavy 70 / 20 / 10. What "
        "fails first in every layout is the short files' target.",
        "",
    ]
    rows, bars = [], {}
    for shape, name in GOODPUT_LAYOUTS:
        record = load(results_dir, name)
        lines += [f"{shape}:", ""] + provenance(record)
        for layout, runs in record["layouts"].items():
            pull = record["kv_pull"].get(layout)
            goodputs = [runs[mix]["app"]["goodput_per_s"] for mix in GOODPUT_MIXES]
            bars[(shape, layout)] = goodputs
            rows.append(
                [
                    shape,
                    layout,
                    *[
                        f"{g:g} /s" if g else f"under {runs[mix]['rates'][0]:g} /s"
                        for g, mix in zip(goodputs, GOODPUT_MIXES)
                    ],
                    f"{pull['p50_s'] * 1000:.1f} / {pull['p95_s'] * 1000:.1f}" if pull else "-",
                ]
            )
        planner = record["planner"]
        rows.append(
            [
                shape,
                "planner's prediction, colocated",
                *[f"{planner[mix]['colocated']:.1f} /s" for mix in GOODPUT_MIXES],
                "",
            ]
        )
    lines += table(["shape", "layout", "default mix", "live-heavy mix", "K/V pull p50 / p95 ms"], rows)
    figure, axis = plt.subplots(figsize=(7, 3.4))
    labels = [f"{shape}\n{mix}" for shape, _ in GOODPUT_LAYOUTS for mix in GOODPUT_MIXES]
    layouts = list(dict.fromkeys(layout for _, layout in bars))
    for offset, layout in enumerate(layouts):
        heights = [
            bars.get((shape, layout), [0, 0])[m] or 0
            for shape, _ in GOODPUT_LAYOUTS
            for m in range(len(GOODPUT_MIXES))
        ]
        drawn = axis.bar([i + (offset - 1) * 0.27 for i in range(len(labels))], heights, 0.25, label=layout)
        bar_labels(axis, [bar for bar in drawn if bar.get_height()], "{:g}")
        for bar in drawn:
            if not bar.get_height():  # no rate measured met every target
                axis.annotate(
                    "below", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", fontsize=7
                )
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylabel("goodput, arrivals / s")
    axis.set_title("One H100: every kind within its target")
    axis.legend(fontsize=8)
    return lines + [save(figure, images_dir, "goodput_one_gpu.png"), ""]


def beams(results_dir: Path) -> list[str]:
    record = load(results_dir, "beams")
    lines = ["## Beam search on one GPU", ""]
    lines += [
        "Beam 5 against greedy decoding, and against transformers' `generate(num_beams=5)`. Each "
        "window's beams decode together with other windows' in one batch and share its one copy of the "
        "cross-attention K/V. Two whole runs.",
        "",
    ]
    lines += provenance(record)
    runs = record["runs"]
    columns = list(runs[0]["beam5_cost"])
    rows = [
        [
            "beam 5's cost in greedy's requests/s",
            *[_spread(runs, "beam5_cost", c, "{:.2f}x") for c in columns],
        ],
        [
            "ours / transformers at beam 5",
            *[_spread(runs, "beam5_ours_over_transformers", c, "{:.1f}x") for c in columns],
        ],
    ]
    header = ["", *[c.replace("/", ", ") + " windows" for c in columns]]
    return lines + table(header, rows)


def _spread(runs: list[dict], field: str, column: str, fmt: str) -> str:
    values = sorted(run[field][column] for run in runs if column in run[field])
    if not values:
        return "-"
    low, high = fmt.format(values[0]), fmt.format(values[-1])
    return low if low == high else f"{low[:-1]}-{high}"


def cpu_app_and_autoscaling(results_dir: Path) -> list[str]:
    load_test = load(results_dir, "load")
    m = load_test["metrics"]
    lines = ["## The served default app on a CPU", ""]
    lines += provenance(load_test)
    lines += table(
        [
            "clients",
            "seconds",
            "answered / sent",
            "lost",
            "p50 / p95 s",
            "tokens/s",
            "KV blocks and staging held at the end",
        ],
        [
            [
                m["clients"],
                m["duration_s"],
                f"{m['answered']} / {m['sent']}",
                m["lost_requests"],
                f"{m['latency_p50_s']:.1f} / {m['latency_p95_s']:.1f}",
                f"{m['tokens_per_s']:.1f}",
                f"{m['kv_blocks_used_at_end']:.0f}, {m['staged_at_end']:.0f}",
            ]
        ],
    )
    scaling = load(results_dir, "autoscaling")
    m = scaling["metrics"]
    lines += ["## Autoscaling on a local three-node cluster", ""]
    lines += [
        "Each side scales on its own signal: a burst of near-silent clips loads the encoders, dense "
        "speech the decoders. The plot is written by the benchmark itself.",
        "",
    ]
    lines += provenance(scaling)
    lines += table(
        ["load", "encoder replicas (most)", "decoder replicas (most)"],
        [
            [
                "near-silent burst",
                m["encoder_replicas_max_encoder_burst"],
                m["decoder_replicas_max_encoder_burst"],
            ],
            ["dense speech", m["encoder_replicas_max_decoder_load"], m["decoder_replicas_max_decoder_load"]],
        ],
    )
    idle = "yes" if m["back_to_one_replica_each_after_idle"] else "no"
    lines += [
        f"Requests lost: {m['lost_requests']} of {m['requests']}; "
        f"back to one replica each when idle: {idle}.",
        "",
    ]
    return lines + ["![autoscaling](../benchmarks/autoscaling.png)", ""]


INTRO = f"""# Performance

<!-- Written by `{REGENERATE}` from benchmarks/results/*.json (make docs). Do not edit by hand. -->

What the system achieves now, against its baselines and peers. Every figure below comes from a JSON
file in `benchmarks/results/`, which records the machine, the date and the command beside it; this
page and its plots are written from those files by `{REGENERATE}`. How results are recorded:
[benchmarks/RESULTS.md](../benchmarks/RESULTS.md).

Read the GPU figures with two things in mind. They use random weights of Whisper large-v3's and
large-v3-turbo's shapes with a fixed number of decoded tokens, so they measure speed, not accuracy
(the accuracy tests use real tiny.en and base weights). And runs of one app on the same kind of
machine differ by up to ~20% from one machine to the next, with the host CPU's speed: compare
figures within a table, where they come from one run or one machine.
"""


def render(results_dir: Path, images_dir: Path) -> str:
    images_dir.mkdir(parents=True, exist_ok=True)
    lines = [INTRO]
    lines += gpu_engine(results_dir, images_dir)
    lines += app_vs_engine(results_dir, images_dir)
    lines += goodput_one_gpu(results_dir, images_dir)
    lines += multi_gpu(results_dir, images_dir)
    lines += beams(results_dir)
    lines += realtime(results_dir, images_dir)
    lines += offline_cpu(results_dir, images_dir)
    lines += cpu_app_and_autoscaling(results_dir)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the recorded JSON files")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="writes performance.md and images/ here")
    args = parser.parse_args()
    page = render(args.results, args.out / "images")
    (args.out / "performance.md").write_text(page)


if __name__ == "__main__":
    main()
