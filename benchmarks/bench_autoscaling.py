"""Autoscaling on a local multi-node Ray cluster (CPU): encoders and decoders scale on their own.
Runs the scenario of tests/support/autoscaling.py (an encoder burst of near-silent clips, idle, a
decoder load of long dense speech, idle) with longer phases, and prints the most replicas of each
side in each phase, the requests sent and lost, whether both sides went back to one replica, and
where the replicas ran. Writes the replica counts over time to benchmarks/autoscaling.png; with
--record, appends the table to the results log (benchmarks/recording.py) and writes
benchmarks/results/autoscaling.json.

    .venv/bin/python benchmarks/bench_autoscaling.py [--burst-s 60] [--load-s 90] [--record]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from tests.support.autoscaling import (  # noqa: E402
    MAX_REPLICAS,
    Timeline,
    run_scenario,
    scenario_config,
    start_app,
    start_cluster,
)

ROOT = Path(__file__).resolve().parents[1]


def plot(timeline: Timeline, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [s[0] for s in timeline.samples]
    figure, axes = plt.subplots(figsize=(9, 3.6))
    axes.step(times, [s[2] for s in timeline.samples], where="post", label="encoder replicas")
    axes.step(times, [s[3] for s in timeline.samples], where="post", label="decoder replicas", linestyle="--")
    for phase in ("encoder burst", "decoder load"):
        phase_times = [s[0] for s in timeline.samples if s[1] == phase]
        if phase_times:
            axes.axvspan(
                min(phase_times),
                max(phase_times),
                alpha=0.12,
                color="tab:green" if "encoder" in phase else "tab:red",
            )
            axes.text(min(phase_times), MAX_REPLICAS + 0.25, phase, fontsize=9)
    axes.set_xlabel("seconds")
    axes.set_ylabel("running replicas")
    axes.set_ylim(0, MAX_REPLICAS + 0.8)
    axes.set_yticks(range(MAX_REPLICAS + 1))
    axes.legend(loc="center right")
    axes.set_title("whisper-disagg autoscaling on a 3-raylet local cluster (CPU, tiny.en)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--burst-s", type=float, default=60)
    parser.add_argument("--load-s", type=float, default=90)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    cluster = start_cluster()
    try:
        url = start_app(cluster, scenario_config())
        result = run_scenario(url, args.burst_s, args.load_s)
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    metrics = result.metrics()
    table = markdown_table(["figure", "value"], [[name, value] for name, value in metrics.items()])
    print(table)
    print("placement:", result.placement)
    if result.outcome.lost:
        print("lost:", result.outcome.lost[:5])
    png = ROOT / "benchmarks" / "autoscaling.png"
    plot(result.timeline, png)
    if args.record:
        notes = (
            f"Replica counts over time: `benchmarks/autoscaling.png`. Placement by custom resource: "
            f"{ {name: sorted(r) for name, r in result.placement.items()} }. Encoder burst: 16 clients "
            f"sending 2 s near-silent clips back to back for {args.burst_s:g} s; decoder load: 5 clients "
            f"sending 85 s dense-speech files for {args.load_s:g} s (client starts spread over the first "
            "half); autoscaling delays 2 s up / 6 s down."
        )
        record(
            "Autoscaling on a local 3-raylet cluster (bench_autoscaling.py)",
            table,
            notes,
            json_path=ROOT / "benchmarks" / "results" / "autoscaling.json",
            metrics=metrics,
        )


if __name__ == "__main__":
    main()
