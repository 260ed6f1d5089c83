"""The application's configuration: what `serve run configs/<x>.yaml` passes as the app's args.

Validated once, when the app is built, so a typo fails `serve run` with a message naming the
field instead of failing the first request.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.config import EngineConfig
from kv_transfer.config import TransferConfig


class ReplicaOptions(BaseModel):
    """Ray resources and queue bounds of one deployment's replicas."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0, description="a fraction (e.g. 0.5) lets encoder and decoder share a GPU")
    max_ongoing_requests: int = Field(64, ge=1, description="requests one replica works on at once")
    max_queued_requests: int = Field(
        256, ge=1, description="requests waiting for a replica; beyond it callers get 503 (back-pressure)"
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per replica; None: torch's default")

    def ray_actor_options(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


class EncoderOptions(ReplicaOptions):
    max_batch_size: int = Field(8, ge=1, description="most 30 s windows in one encoder forward")
    batch_wait_timeout_ms: float = Field(10.0, ge=0, description="how long a batch waits to fill")


class DecoderOptions(ReplicaOptions):
    max_ongoing_requests: int = Field(512, ge=1, description="windows admitted to one decoder's queue at once")


class HTTPLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_upload_mb: float = Field(25.0, gt=0, description="OpenAI's limit is 25 MB")
    max_audio_duration_s: float = Field(3600.0, gt=0)
    api_keys: list[str] = Field(default_factory=list, description="when non-empty, requests need `Authorization: Bearer <key>`")


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    served_model_names: list[str] = Field(
        default_factory=lambda: ["whisper-1"],
        description="names clients may send as `model`; the engine's model is always accepted too",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    encoder: EncoderOptions = Field(default_factory=EncoderOptions)
    decoder: DecoderOptions = Field(default_factory=DecoderOptions)
    ingress: ReplicaOptions = Field(default_factory=lambda: ReplicaOptions(num_cpus=0.5))
    http: HTTPLimits = Field(default_factory=HTTPLimits)

    @field_validator("served_model_names")
    @classmethod
    def _names_are_not_paths(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("served_model_names needs at least one name")
        return names

    @property
    def accepted_model_names(self) -> set[str]:
        return {*self.served_model_names, self.engine.model}


class ConfigError(ValueError):
    """The app's configuration is invalid; the message lists every bad field and why."""


def parse_app_config(args: dict[str, Any] | None) -> AppConfig:
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as error:
        problems = "\n".join(
            f"  {'.'.join(str(part) for part in item['loc']) or '(top level)'}: {item['msg']}"
            for item in error.errors()
        )
        raise ConfigError(f"invalid whisper-disagg app config:\n{problems}") from None
