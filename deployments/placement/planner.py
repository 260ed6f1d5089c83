"""Placement chosen by measurement: from one GPU's calibration profile and a mix of traffic, the
capacity of each way to lay the app out on ``gpus`` GPUs, and the best of them.

The model is a utilisation count, nothing more:

- **Speeds.** The encoder costs ``encoder_batch_s[b] / b`` seconds a window at the batch ``b`` it
  runs (the most efficient profiled batch up to ``max_encoder_batch``: near capacity the queue fills
  the batches); the decoder costs ``decoder_step_s[r] / r`` seconds a token at ``r`` rows a step (the
  most efficient profiled rows up to ``max_decode_rows``: every row gains one token a step).
- **Work a request brings.** A file of ``w`` windows encodes ``w`` windows and decodes
  ``w * tokens_per_window`` tokens. A live stream also passes its audio so far through both sides
  every ``partial_interval_s``: ``audio_s / partial_interval_s`` partial passes, each encoding one
  window and decoding half a window's tokens on average (its window's audio grows from nothing to
  full between final passes).
- **Work a second.** At a total arrival rate ``R`` split by the mix's fractions ``p_k``: encoder work
  ``E * R`` with ``E = sum_k p_k * windows_k * s_per_window`` (GPU-seconds a second), decoder work
  ``D * R`` with ``D = sum_k p_k * tokens_k * s_per_token``; apart, every encoded window's K/V is
  pulled, ``T * R`` more of the decoder's time with ``T = sum_k p_k * windows_k * kv_transfer_s``.
- **Layouts.** ``G`` colocated replicas share each GPU between both sides, so a GPU's utilisation is
  the sum ``R * s * (E + D) / G``, where ``s`` (``colocated_slowdown``, 1 unless measured) is what
  sharing costs each side: decode steps slowed by encoder batches beside them. A disaggregated
  split of ``e`` encoder GPUs and ``d = G - e`` decoder GPUs gives each side its own: ``R * E / e``
  and ``R * (D + T) / d``.
- **Goodput.** The highest ``R`` at which every GPU stays at or under ``utilisation_ceiling`` (the
  headroom queues need to keep latency bounded): ``ceiling * G / (s * (E + D))`` colocated,
  ``ceiling * min(e / E, d / (D + T))`` split. The best layout has the highest; a tie goes to
  colocated, which moves no K/V.

With ``s`` at 1 a split never beats colocated replicas here (a shared GPU wastes nothing, and a
split can only match it where ``e : d`` is exactly ``E : D + T``); a split wins when sharing costs
more than pulling K/V, and the recommended split follows the mix: the more encoder work, the more
encoder GPUs. What the model leaves out, on purpose: latency targets (the goodput benchmark
measures them) and a process bound that keeps a GPU below full use; a profile measured under the
same conditions folds them into its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from deployments.placement.inputs import CalibrationProfile, PlanInputError, TrafficKind, TrafficMix


class PlanSettings(BaseModel):
    """What the planner assumes beyond the profile and the mix."""

    model_config = ConfigDict(extra="forbid")

    utilisation_ceiling: float = Field(
        0.85, gt=0, le=1, description="the busiest a GPU may be and still count as serving in time"
    )
    max_encoder_batch: int | None = Field(
        None, ge=1, description="the most windows one forward takes (default: the profile's largest)"
    )
    max_decode_rows: int | None = Field(
        None,
        ge=1,
        description="the most rows a step runs, engine.max_num_seqs (default: the profile's largest)",
    )
    # 1 unless given: a calibration profile times the engine alone, one side at a time, so it holds
    # no measure of what sharing costs, and the app's colocated runs time whole steps with the host's
    # work in them, on other cards than the profiles'. At 1 the colocated figure is a ceiling and a
    # tie goes to colocated (it moves no K/V, and the measured split-against-colocated runs ranked it
    # first too); a split is recommended only once a measured slowdown says sharing costs more.
    colocated_slowdown: float = Field(
        1.0,
        ge=1,
        description="how much more GPU time both sides take when they share a GPU (a colocated run's "
        "figures over the engine alone's); 1: sharing costs nothing",
    )


@dataclass(frozen=True)
class Speeds:
    """The profile's figures the plan uses."""

    encoder_batch: int
    encoder_s_per_window: float
    decode_rows: int
    decoder_s_per_token: float
    kv_transfer_s_per_window: float


@dataclass(frozen=True)
class KindLoad:
    """What one request of a kind asks of each side."""

    name: str
    fraction: float  # of all arrivals
    windows_encoded: float  # final windows and partial passes
    tokens_decoded: float
    encoder_s: float  # GPU-seconds
    decoder_s: float
    transfer_s: float  # of the decoder's time, where encoder and decoder are apart


@dataclass(frozen=True)
class Layout:
    encoder_gpus: int  # 0 where colocated
    decoder_gpus: int  # 0 where colocated
    colocated_gpus: int = 0

    @property
    def label(self) -> str:
        if self.colocated_gpus:
            return f"colocated x{self.colocated_gpus}"
        return f"split {self.encoder_gpus}:{self.decoder_gpus}"


@dataclass(frozen=True)
class LayoutPrediction:
    """One layout's capacity. Utilisations are of each GPU of that side (colocated: each side's part of
    every GPU), per request a second of arrivals: multiply by a rate for the utilisation at that rate."""

    layout: Layout
    encoder_utilisation_per_rate: float
    decoder_utilisation_per_rate: float
    goodput_per_s: float

    def utilisation_at(self, rate_per_s: float) -> tuple[float, float]:
        return rate_per_s * self.encoder_utilisation_per_rate, rate_per_s * self.decoder_utilisation_per_rate

    @property
    def bound_by(self) -> str:
        """The side that reaches the ceiling first."""
        if self.layout.colocated_gpus:
            return "the shared GPU"
        encoder, decoder = self.encoder_utilisation_per_rate, self.decoder_utilisation_per_rate
        return "encoder" if encoder > decoder else "decoder" if decoder > encoder else "both sides"


@dataclass(frozen=True)
class Plan:
    gpus: int
    settings: PlanSettings
    speeds: Speeds
    kinds: list[KindLoad]
    # E, D and T: the GPU-seconds of each side an average arrival brings
    encoder_s_per_request: float
    decoder_s_per_request: float
    transfer_s_per_request: float
    layouts: list[LayoutPrediction]  # colocated first, then splits by encoder GPUs
    given_rate_per_s: float | None  # where the mix gives rates

    @property
    def recommended(self) -> LayoutPrediction:
        best = self.layouts[0]
        for prediction in self.layouts[1:]:
            if prediction.goodput_per_s > best.goodput_per_s * (1 + 1e-9):
                best = prediction
        return best


def most_efficient(seconds_by_size: dict[int, float], largest: int | None, setting: str) -> tuple[int, float]:
    """The profiled size up to ``largest`` with the fewest seconds per unit, and those seconds."""
    sizes = [size for size in seconds_by_size if largest is None or size <= largest]
    if not sizes:
        raise PlanInputError(
            f"{setting} is {largest}, below every size the profile measured ({sorted(seconds_by_size)})"
        )
    size = min(sizes, key=lambda size: seconds_by_size[size] / size)
    return size, seconds_by_size[size] / size


def speeds_of(profile: CalibrationProfile, settings: PlanSettings) -> Speeds:
    encoder_batch, per_window = most_efficient(
        profile.encoder_batch_s, settings.max_encoder_batch, "max_encoder_batch"
    )
    rows, per_token = most_efficient(profile.decoder_step_s, settings.max_decode_rows, "max_decode_rows")
    return Speeds(encoder_batch, per_window, rows, per_token, profile.kv_transfer_s_per_window or 0.0)


def kind_load(kind: TrafficKind, fraction: float, speeds: Speeds) -> KindLoad:
    windows, tokens = float(kind.request_windows), kind.request_windows * kind.tokens_per_window
    if kind.partial_interval_s is not None:
        partial_passes = kind.audio_s / kind.partial_interval_s
        windows += partial_passes
        tokens += partial_passes * kind.tokens_per_window / 2
    return KindLoad(
        name=kind.name,
        fraction=fraction,
        windows_encoded=windows,
        tokens_decoded=tokens,
        encoder_s=windows * speeds.encoder_s_per_window,
        decoder_s=tokens * speeds.decoder_s_per_token,
        transfer_s=windows * speeds.kv_transfer_s_per_window,
    )


def predict(
    layout: Layout, encoder_s: float, decoder_s: float, transfer_s: float, settings: PlanSettings
) -> LayoutPrediction:
    """``layout``'s utilisations per unit arrival rate and its goodput, from the mix's ``E``, ``D``, ``T``."""
    colocated_slowdown = settings.colocated_slowdown
    if layout.colocated_gpus:
        encoder = colocated_slowdown * encoder_s / layout.colocated_gpus
        decoder = colocated_slowdown * decoder_s / layout.colocated_gpus
        busiest = encoder + decoder
    else:
        encoder = encoder_s / layout.encoder_gpus
        decoder = (decoder_s + transfer_s) / layout.decoder_gpus
        busiest = max(encoder, decoder)
    return LayoutPrediction(layout, encoder, decoder, settings.utilisation_ceiling / busiest)


def layouts_for(gpus: int) -> list[Layout]:
    """Colocated on every GPU, then every split that leaves each side at least one GPU."""
    return [Layout(0, 0, colocated_gpus=gpus)] + [
        Layout(encoder, gpus - encoder) for encoder in range(1, gpus)
    ]


def plan(
    profile: CalibrationProfile, mix: TrafficMix, gpus: int, settings: PlanSettings | None = None
) -> Plan:
    if gpus < 1:
        raise PlanInputError(f"gpus must be at least 1, got {gpus}")
    settings = settings or PlanSettings()
    speeds = speeds_of(profile, settings)
    fractions = mix.fractions()
    kinds = [kind_load(kind, fractions[kind.name], speeds) for kind in mix.kinds]
    work = (
        sum(kind.fraction * kind.encoder_s for kind in kinds),
        sum(kind.fraction * kind.decoder_s for kind in kinds),
        sum(kind.fraction * kind.transfer_s for kind in kinds),
    )
    layouts = [predict(layout, *work, settings) for layout in layouts_for(gpus)]
    return Plan(gpus, settings, speeds, kinds, *work, layouts, mix.given_rate_per_s)
