"""Config -> Serve application: `serve run configs/default.yaml` calls ``build_app`` with the
YAML's `args`, validated here before any replica starts."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.config import AppConfig, ReplicaOptions, parse_app_config
from deployments.decoder import DecoderDeployment
from deployments.encoder import EncoderDeployment
from deployments.ingress import Ingress


def _deployment_options(name: str, options: ReplicaOptions) -> dict[str, Any]:
    return {
        "name": name,
        "num_replicas": options.num_replicas,
        "ray_actor_options": options.ray_actor_options(),
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
    }


def build_whisper_app(config: AppConfig) -> Application:
    encoder = serve.deployment(EncoderDeployment).options(**_deployment_options("WhisperEncoder", config.encoder))
    decoder = serve.deployment(DecoderDeployment).options(**_deployment_options("WhisperDecoder", config.decoder))
    ingress = serve.deployment(Ingress).options(**_deployment_options("WhisperIngress", config.ingress))
    return ingress.bind(config, encoder.bind(config), decoder.bind(config))


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The app builder named by `import_path: deployments.app:build_app` in configs/*.yaml."""
    return build_whisper_app(parse_app_config(args))
