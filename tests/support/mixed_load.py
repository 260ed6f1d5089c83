"""Open-loop mixed load: when requests of each kind arrive, what each kind must achieve, and what a
sweep of arrival rates serves within target (goodput). Pure arithmetic over recorded outcomes, so
tests can check the rules without a server; benchmarks/bench_goodput.py sends the traffic."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arrival:
    """One request of an open-loop schedule: sent at ``at_s`` from the schedule's start whether or
    not earlier ones have been answered. ``seed``: picks its audio, so the same schedule sends the
    same audio to the app and to the engine alone."""

    at_s: float
    kind: str
    seed: int


def poisson_arrivals(
    rate_per_s: float, duration_s: float, shares: dict[str, float], seed: int
) -> list[Arrival]:
    """Arrivals of a Poisson process at ``rate_per_s`` in all over ``[0, duration_s)``, each of a kind
    drawn by ``shares`` (weights, need not sum to 1). Exponential gaps make the load open: a slow
    server does not slow the arrivals, as a closed loop of clients would."""
    kinds = [kind for kind, share in shares.items() if share > 0]
    if rate_per_s <= 0 or not kinds:
        return []
    weights = [shares[kind] for kind in kinds]
    draw = random.Random(seed)
    arrivals, at_s = [], draw.expovariate(rate_per_s)
    while at_s < duration_s:
        arrivals.append(Arrival(at_s, draw.choices(kinds, weights)[0], draw.getrandbits(32)))
        at_s += draw.expovariate(rate_per_s)
    return arrivals


@dataclass
class Outcome:
    """What one arrival got. ``latencies_s``: one per answer it waited for (a file: one; a live
    stream: one per turn, from the end of the turn's audio to its final text); ``expected``: how
    many it should have had; ``status``: "ok", an HTTP status or the error's name."""

    kind: str
    audio_s: float
    expected: int
    latencies_s: list[float] = field(default_factory=list)
    status: str = "ok"


@dataclass(frozen=True)
class Target:
    """A kind's latency target: the p95 of its figure at most ``p95_max``. The figure is the
    latency in seconds, or with ``per_audio_s`` the latency over the audio's length (a batch file
    is on time when it is done within its own length)."""

    p95_max: float
    per_audio_s: bool = False

    def describe(self) -> str:
        return f"p95 <= {self.p95_max:.3g}x audio" if self.per_audio_s else f"p95 <= {self.p95_max:.3g} s"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


@dataclass(frozen=True)
class KindSummary:
    kind: str
    sent: int
    completed: int
    errors: dict[str, int]
    p50_s: float
    p95_s: float
    target_figure_p95: float  # what the target is judged on: answers missing count as infinitely late
    target: Target

    @property
    def met(self) -> bool | None:
        """None when nothing of this kind was sent: there is nothing to judge."""
        return None if self.sent == 0 else self.target_figure_p95 <= self.target.p95_max


def summarize(kind: str, outcomes: list[Outcome], target: Target) -> KindSummary:
    """A kind's figures over its outcomes. A request that failed, or a stream turn that never got
    its text, is a late answer (infinitely so) for the target, so errors count against goodput
    rather than vanishing from the percentiles; p50/p95 are over the answers received."""
    mine = [outcome for outcome in outcomes if outcome.kind == kind]
    received = [latency for outcome in mine for latency in outcome.latencies_s]
    figures = []
    for outcome in mine:
        scale = outcome.audio_s if target.per_audio_s else 1.0
        figures += [latency / scale for latency in outcome.latencies_s]
        figures += [math.inf] * max(0, outcome.expected - len(outcome.latencies_s))
    errors = Counter(outcome.status for outcome in mine if outcome.status != "ok")
    return KindSummary(
        kind,
        len(mine),
        sum(outcome.status == "ok" for outcome in mine),
        dict(sorted(errors.items())),
        percentile(received, 0.5),
        percentile(received, 0.95),
        percentile(figures, 0.95),
        target,
    )


def all_met(summaries: list[KindSummary]) -> bool:
    """Every kind sent at this rate met its target (a kind with nothing sent does not count)."""
    return all(summary.met is not False for summary in summaries)


def goodput(met_by_rate: dict[float, bool]) -> float | None:
    """The highest rate of the sweep at which every kind met its target; None if none did."""
    return max((rate for rate, met in met_by_rate.items() if met), default=None)
