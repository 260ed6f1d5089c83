"""One model of an app that serves several (the app config's `models:`): its ids, its engine and
its own encoder and decoder deployments. deployments/config.py turns a one-model config into one
of these too, so the app is built from a list of models whichever shape its config has."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.replica_options import DecoderOptions, EncoderOptions
from engine.config import EngineConfig
from kv_transfer.config import TransferConfig

Placement = Literal["disaggregated", "colocated"]
PLACEMENT_DESCRIPTION = (
    "disaggregated: encoder and decoder replicas are deployments of their own, scaled apart, the K/V "
    "moving between them (`transfer`); colocated: each decoder replica encodes its own windows, in one "
    "process on two CUDA streams (on one GPU two processes' kernels take turns: docs/gpu.md, 'One GPU'); "
    "`encoder` then sets only its batching, `decoder` the replicas"
)
# The sections of the app config that describe its one model; with `models:` each model has its own.
MODEL_SECTIONS = ("served_model_names", "placement", "engine", "transfer", "encoder", "decoder")


class ModelSections(BaseModel):
    """How one model runs: its placement, engine, K/V transfer and its encoder and decoder
    deployments (a one-model app config's top level, and each entry of `models:`)."""

    model_config = ConfigDict(extra="forbid")

    placement: Placement = Field("disaggregated", description=PLACEMENT_DESCRIPTION)
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the model and how it runs")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="how the K/V travels")
    encoder: EncoderOptions = Field(default_factory=EncoderOptions, description="the encoder deployment")
    decoder: DecoderOptions = Field(default_factory=DecoderOptions, description="the decoder deployment")


class ModelConfig(ModelSections):
    """One model of an app that serves several: its own engine settings and its own encoder and
    decoder deployments (replicas, autoscaling, placement), which start, scale and fail apart from
    the other models'. Requests choose it by their `model` field."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        min_length=1,
        description="the id clients send as `model` and /v1/models lists; None: engine.model",
    )
    aliases: list[str] = Field(
        default_factory=list, description="more ids that choose this model, e.g. [whisper-1]"
    )
    default: bool = Field(
        False,
        description="the model a realtime session uses until it chooses one; exactly one model is the "
        "default (a lone model is, unmarked)",
    )

    @model_validator(mode="after")
    def _named_by_its_engine_unless_named(self) -> "ModelConfig":
        if self.name is None:
            self.name = self.engine.model
        return self

    @property
    def ids(self) -> list[str]:
        """Every id that chooses this model: its name, then its aliases."""
        return [self.name, *self.aliases]

    @property
    def deployment_suffix(self) -> str:
        """The model's name as Serve deployment names may carry it."""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", self.name)
