"""What the placement planner reads: a calibration profile of one GPU (what
benchmarks/calibrate_placement.py writes) and a described mix of traffic, each a JSON or YAML file.

Both are validated when read, so a typo or a missing figure fails with the file and the field
named instead of a plan built on a wrong number.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from deployments.config import validation_problems
from engine import CHUNK_LENGTH_S


class PlanInputError(ValueError):
    """A profile or mix file is missing, unreadable or invalid; the message names the file and field."""


class CalibrationProfile(BaseModel):
    """One GPU's speeds, measured with the engine alone (benchmarks/calibrate_placement.py)."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("", description="what was measured: the GPU's name, or cpu")
    model: str = Field("", description="the model or random-weight shape measured")
    note: str = Field("", description="free text: how it was measured, or that the numbers are made up")
    encoder_batch_s: dict[PositiveInt, PositiveFloat] = Field(
        ...,
        min_length=1,
        description="batch size -> seconds one encoder forward of that many 30 s windows takes (log-mel, "
        "encoder and cross-K/V projection: all the work a window costs before its first decode step)",
    )
    decoder_step_s: dict[PositiveInt, PositiveFloat] = Field(
        ...,
        min_length=1,
        description="rows -> seconds one whole engine step takes with that many rows decoding (each row "
        "gains one token a step)",
    )
    kv_transfer_s_per_window: float | None = Field(
        None,
        ge=0,
        description="seconds of the decoder's time one window's K/V pull costs when encoder and decoder "
        "are apart (benchmarks/bench_kv_pull.py); none: pulls cost the decoder nothing",
    )


class TrafficKind(BaseModel):
    """One kind of request in the mix: live streams, short files or long files."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1)
    share: PositiveFloat | None = Field(
        None, description="this kind's part of the arrivals (any scale: the shares are normalised)"
    )
    rate_per_s: PositiveFloat | None = Field(
        None, description="arrivals a second (instead of share): the plan also says whether this load fits"
    )
    audio_s: PositiveFloat = Field(..., description="audio a request carries (a live stream: its length)")
    windows: PositiveInt | None = Field(
        None, description="windows a request is cut into; default: its audio over 30 s, rounded up"
    )
    tokens_per_window: PositiveFloat = Field(
        ..., description="decode steps a window's final text takes (its prompt steps included)"
    )
    partial_interval_s: PositiveFloat | None = Field(
        None,
        description="live streams: how often the audio so far is transcribed again for partial text "
        "(realtime.partial_interval_ms); none for files",
    )

    @property
    def request_windows(self) -> int:
        return self.windows or math.ceil(self.audio_s / CHUNK_LENGTH_S)


class TrafficMix(BaseModel):
    """The traffic to plan for: each kind's part of the arrivals and what one request of it asks for."""

    model_config = ConfigDict(extra="forbid")

    note: str = Field("", description="free text: where the mix comes from")
    kinds: list[TrafficKind] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _one_way_to_weigh_the_kinds(self) -> TrafficMix:
        names = [kind.name for kind in self.kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"kinds: each name once, got {names}")
        for kind in self.kinds:
            if (kind.share is None) == (kind.rate_per_s is None):
                raise ValueError(f"kinds.{kind.name}: give exactly one of share and rate_per_s")
        if len({kind.share is None for kind in self.kinds}) > 1:
            raise ValueError("kinds: give every kind a share, or every kind a rate_per_s, not some of each")
        return self

    @property
    def given_rate_per_s(self) -> float | None:
        """The total arrival rate the mix asks for, where it gives rates rather than shares."""
        if self.kinds[0].rate_per_s is None:
            return None
        return sum(kind.rate_per_s for kind in self.kinds)

    def fractions(self) -> dict[str, float]:
        """Each kind's fraction of all arrivals."""
        weights = {kind.name: kind.share or kind.rate_per_s for kind in self.kinds}
        total = sum(weights.values())
        return {name: weight / total for name, weight in weights.items()}


def _read(path: Path) -> object:
    try:
        return yaml.safe_load(Path(path).read_text())  # YAML reads JSON too
    except (OSError, yaml.YAMLError) as error:
        raise PlanInputError(f"{path}: cannot read it: {error}") from None


def _validated(model: type[BaseModel], path: Path, what: str):
    try:
        return model.model_validate(_read(path))
    except ValidationError as error:
        raise PlanInputError(f"{path}: invalid {what}:\n{validation_problems(error)}") from None


def load_profile(path: Path) -> CalibrationProfile:
    return _validated(CalibrationProfile, path, "calibration profile")


def load_mix(path: Path) -> TrafficMix:
    return _validated(TrafficMix, path, "traffic mix")
