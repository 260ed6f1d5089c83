"""The rules of the open-loop mixed-load benchmark (tests/support/mixed_load.py): Poisson arrivals at
the asked rate and mix, errors counting against a kind's target, and goodput as the highest rate at
which every kind met its target."""

from __future__ import annotations

import math
import statistics

from tests.support.mixed_load import Outcome, Target, all_met, goodput, poisson_arrivals, summarize


def test_arrivals_come_at_the_asked_rate_in_the_asked_mix_with_exponential_gaps():
    arrivals = poisson_arrivals(4.0, 2000.0, {"live": 1.0, "short": 3.0, "long": 0.0}, seed=1)
    assert 0.95 * 8000 < len(arrivals) < 1.05 * 8000
    assert all(0 <= a.at_s < 2000 for a in arrivals)
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    kinds = [a.kind for a in arrivals]
    assert "long" not in kinds
    assert 0.72 < kinds.count("short") / len(kinds) < 0.78
    gaps = [b.at_s - a.at_s for a, b in zip(arrivals, arrivals[1:])]
    # An exponential gap's standard deviation equals its mean (a fixed-interval schedule's is 0).
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 0.9


def test_the_same_seed_gives_the_same_schedule():
    shares = {"live": 1.0, "short": 1.0}
    assert poisson_arrivals(1.0, 60.0, shares, seed=7) == poisson_arrivals(1.0, 60.0, shares, seed=7)
    assert poisson_arrivals(1.0, 60.0, shares, seed=7) != poisson_arrivals(1.0, 60.0, shares, seed=8)


def test_a_failed_request_counts_as_infinitely_late_against_the_target():
    answered = [Outcome("short", 5.0, 1, [0.5]) for _ in range(19)]
    summary = summarize("short", [*answered, Outcome("short", 5.0, 1, status="429")], Target(1.0))
    assert summary.errors == {"429": 1} and summary.completed == 19
    assert summary.p95_s == 0.5  # over the answers received
    assert summary.met  # one in twenty late is within a p95
    two_failed = [*answered[:18], *[Outcome("short", 5.0, 1, status="503")] * 2]
    assert math.isinf(summarize("short", two_failed, Target(1.0)).target_figure_p95)


def test_a_long_file_is_judged_by_its_latency_over_its_own_length():
    outcomes = [Outcome("long", 600.0, 1, [300.0]), Outcome("long", 60.0, 1, [90.0])]
    assert not summarize("long", outcomes, Target(1.0, per_audio_s=True)).met
    assert summarize("long", outcomes[:1], Target(1.0, per_audio_s=True)).met


def test_a_live_stream_turn_without_its_text_counts_as_late():
    stream = Outcome("live", 15.0, expected=3, latencies_s=[0.2, 0.3])
    assert math.isinf(summarize("live", [stream], Target(0.5)).target_figure_p95)


def test_goodput_is_the_highest_rate_at_which_every_kind_met_its_target():
    on_time = summarize("short", [Outcome("short", 5.0, 1, [0.5])], Target(1.0))
    late = summarize("live", [Outcome("live", 15.0, 1, [2.0])], Target(1.0))
    nothing_sent = summarize("long", [], Target(1.0, per_audio_s=True))
    assert all_met([on_time, nothing_sent]) and not all_met([on_time, late])
    assert goodput({0.5: True, 1.0: True, 2.0: False, 4.0: False}) == 1.0
    assert goodput({0.5: False, 1.0: False}) is None
