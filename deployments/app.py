"""Config -> Serve application: `serve run configs/default.yaml` calls ``build_app`` with the
YAML's `args`, validated here before any replica starts."""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from deployments.autoscaling import DecoderPolicy, EncoderPolicy
from deployments.config import AppConfig, parse_app_config
from deployments.decoder import DecoderDeployment
from deployments.diarizer import DiarizerDeployment
from deployments.encoder import EncoderDeployment
from deployments.ingress import Ingress
from deployments.model_config import ModelConfig
from deployments.replica_options import ReplicaOptions
from deployments.routing import MostFreeKVBlocksRouter, SessionRoomRouter


def _deployment_options(
    name: str,
    options: ReplicaOptions,
    policy: type | None = None,
    policy_kwargs: dict[str, Any] | None = None,
    access_log: bool = True,
) -> dict[str, Any]:
    """``access_log``: Serve's line per call to a replica. The ingress keeps it (one line per client
    request, with its status and request id); the encoders and decoders, whose calls are the
    ingress's and each other's (a window each, and the encoders' polls of the decoders' load many
    times a second while they have windows), go without, so that the log has a line per request."""
    deployment = {
        "logging_config": {"enable_access_log": access_log},
        "name": name,
        "ray_actor_options": options.ray_actor_options(),
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
        # Scale-down and redeploys drain: the replica leaves the router's set, then Serve waits for
        # its ongoing calls (and its __del__) up to drain_timeout_s before stopping it.
        "graceful_shutdown_timeout_s": options.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    scaling = options.autoscaling
    if scaling is None:
        deployment["num_replicas"] = options.num_replicas
        return deployment
    deployment["autoscaling_config"] = AutoscalingConfig(
        min_replicas=scaling.min_replicas,
        max_replicas=scaling.max_replicas,
        initial_replicas=scaling.initial_replicas
        if scaling.initial_replicas is not None
        else max(1, scaling.min_replicas),
        upscale_delay_s=scaling.upscale_delay_s,
        downscale_delay_s=scaling.downscale_delay_s,
        metrics_interval_s=scaling.metrics_interval_s,
        look_back_period_s=scaling.look_back_period_s,
        # Serve's default policy (requests per replica) for the ingress; the sides' own signal otherwise.
        **(
            {"policy": AutoscalingPolicy(policy_function=policy, policy_kwargs=policy_kwargs or {})}
            if policy
            else {}
        ),
    )
    return deployment


def _model_deployments(config: AppConfig, model: ModelConfig) -> tuple[Application | None, Application]:
    """One model's encoder and decoder deployments (no encoder when colocated), bound to the
    model's view of the config. With several models, their names carry the model's."""
    served = config.serving(model)
    suffix = f"-{model.deployment_suffix}" if len(config.models) > 1 else ""
    encoder = serve.deployment(EncoderDeployment).options(
        **_deployment_options(
            f"WhisperEncoder{suffix}",
            served.encoder,
            EncoderPolicy,
            {"target_pending_windows": served.encoder.target_pending_windows},
            access_log=False,
        )
    )
    decoder = serve.deployment(DecoderDeployment).options(
        **_deployment_options(
            f"WhisperDecoder{suffix}",
            served.decoder,
            DecoderPolicy,
            {
                "target_kv_utilization": served.decoder.target_kv_utilization,
                "interactive_slots_reserved": served.engine.interactive_reserved_seqs > 0,
            },
            access_log=False,
        ),
        request_router_config=RequestRouterConfig(
            request_router_class=MostFreeKVBlocksRouter,
            request_routing_stats_period_s=served.decoder.routing_stats_period_s,
        ),
        # The check is whether the engine's process lives: cheap, and a replica without one
        # answers nothing but errors until it is replaced.
        health_check_period_s=2.0,
    )
    decoders = decoder.bind(served)
    if served.colocated:  # the decoder replicas encode their own windows
        return None, decoders
    return encoder.bind(served, decoders), decoders


def _diarizer_deployment(config: AppConfig) -> Application | None:
    """The app's one diarizer (who speaks does not depend on the model), scaled on Serve's own
    policy: its load is requests, one recording each. None without a `diarizer` section."""
    if config.diarizer is None:
        return None
    diarizer = serve.deployment(DiarizerDeployment).options(
        **_deployment_options("WhisperDiarizer", config.diarizer)
    )
    return diarizer.bind(config.diarizer)


def behind_haproxy() -> bool:
    """Whether Serve puts HAProxy in front of the ingress replicas instead of its proxy actor.

    Serve exposes the switch only as an environment variable (docs/operations.md sets it on
    `serve run`) and its parsed value only under ``ray.serve._private``, which may move or change
    in any release. So this reads the variable itself, with Serve's default (off) and Serve's rule
    (only "1" turns it on), so that it agrees with the check in Serve's build and in its controller,
    which inherits this process's environment."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"


def build_whisper_app(config: AppConfig) -> Application:
    """The ingress, bound to every model's encoder and decoder deployments by model name, and to the
    diarizer. Each is a Serve deployment of its own: they start, scale and fail apart."""
    ingress_options = _deployment_options("WhisperIngress", config.ingress)
    if runtime_env := config.http.ingress_runtime_env():
        ingress_options["ray_actor_options"]["runtime_env"] = runtime_env
    if not behind_haproxy():
        # Behind HAProxy (docs/operations.md) HAProxy picks the replica itself, by least connections
        # (a live session is one while it lasts), and Serve refuses a router on the ingress.
        ingress_options["request_router_config"] = RequestRouterConfig(
            request_router_class=SessionRoomRouter,
            request_routing_stats_period_s=config.realtime.routing_stats_period_s,
        )
    ingress = serve.deployment(Ingress).options(**ingress_options)
    return ingress.bind(
        config,
        {model.name: _model_deployments(config, model) for model in config.models},
        _diarizer_deployment(config),
    )


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The app builder named by `import_path: deployments.app:build_app` in configs/*.yaml."""
    return build_whisper_app(parse_app_config(args))
