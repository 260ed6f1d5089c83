"""The models an ingress routes to, by the id a request sends as `model` (a name or an alias): each
model's window pipeline through its own encoder and decoder deployments, its readiness, and the
decode options its decoders have accepted. Nothing here is shared between models, so a model whose
replicas are lost or never started fails its own requests and no other's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from ray.exceptions import RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig, RealtimeOptions
from deployments.http.errors import APIError
from deployments.http.option_checks import AcceptedOptions
from deployments.http.readiness import Readiness
from deployments.model_config import ModelConfig
from deployments.orchestration.pipeline import WindowPipeline
from deployments.replica_stats import answered
from engine.errors import RequestRejectedError
from engine.types import DecodeOptions


@dataclass
class ServedModel:
    name: str
    ids: tuple[str, ...]  # its name, then its aliases
    pipeline: WindowPipeline | None
    accepted_options: AcceptedOptions
    readiness: Readiness | None = None
    encoder: DeploymentHandle | None = None  # None: colocated, its decoder replicas encode
    decoder: DeploymentHandle | None = None
    # The app's realtime options as chosen for this model's device (RealtimeOptions.on), which its
    # encoders prepared for; None: a live session's own options, unchosen.
    realtime: RealtimeOptions | None = None

    @classmethod
    def of(
        cls,
        config: AppConfig,
        model: ModelConfig,
        encoder: DeploymentHandle | None,
        decoder: DeploymentHandle,
    ) -> ServedModel:
        # Each handle starts following its deployment now rather than at its first call: a call made
        # before a handle knows its deployment failed to start waits for a replica forever, while one
        # made after fails at once (DeploymentUnavailableError), which answers as this model's 503.
        encoder = encoder.options() if encoder is not None else None
        decoder = decoder.options()
        pipeline = WindowPipeline(encoder, decoder, config.http.max_windows_in_flight)
        return cls(
            name=model.name,
            ids=tuple(model.ids),
            pipeline=pipeline,
            accepted_options=AcceptedOptions(lambda options: decoder.check_options.remote(options)),
            readiness=Readiness.of_pipeline(pipeline),
            encoder=encoder,
            decoder=decoder,
            realtime=config.serving(model).realtime,
        )

    async def check_options(self, options: DecodeOptions) -> None:
        """Raise if this model cannot decode with ``options``. Translation asked of an English-only
        model is the client's choice of model, so the answer names the model."""
        try:
            await self.accepted_options.check(options)
        except DeploymentUnavailableError:
            raise APIError(
                503,
                f"The model '{self.name}' is unavailable: its replicas failed to start (the server's "
                "other models still serve). Retry later.",
                param="model",
                code="model_unavailable",
                error_type="server_error",
                retry_after_s=30,
            ) from None
        except Exception as error:
            cause = error.cause if isinstance(error, RayTaskError) else error
            english_only = isinstance(cause, RequestRejectedError) and cause.param == "task"
            if english_only and options.task == "translate":
                raise APIError(
                    400,
                    f"The model '{self.name}' is English-only and cannot translate; send translations to "
                    "a multilingual model.",
                    param="model",
                    code="model_cannot_translate",
                ) from None
            raise

    async def replica_stats(self) -> tuple[list, list]:
        """Every encoder and decoder replica's figures that answered in time (colocated, the decoder
        replicas report their encoders' figures too)."""
        colocated = self.encoder is None
        encoders, method = (self.decoder, "encoder_stats") if colocated else (self.encoder, "stats")
        encoder_stats, decoder_stats = await asyncio.gather(
            answered(encoders, method), answered(self.decoder, "stats")
        )
        return encoder_stats, decoder_stats


@dataclass
class ServedModels:
    models: list[ServedModel]
    default_name: str
    _by_id: dict[str, ServedModel] = field(init=False)

    def __post_init__(self) -> None:
        self._by_id = {model_id: model for model in self.models for model_id in model.ids}

    @classmethod
    def of(
        cls, config: AppConfig, handles: dict[str, tuple[DeploymentHandle | None, DeploymentHandle]]
    ) -> ServedModels:
        """``handles``: each model's (encoder, decoder) deployments by name, as the app binds them."""
        return cls(
            [ServedModel.of(config, model, *handles[model.name]) for model in config.models],
            config.default_model.name,
        )

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    @property
    def ids(self) -> list[str]:
        """Every id a request may send as `model`, model by model."""
        return [model_id for model in self.models for model_id in model.ids]

    @property
    def default(self) -> ServedModel:
        return self._by_id[self.default_name]

    def named(self, model_id: str) -> ServedModel | None:
        return self._by_id.get(model_id)
