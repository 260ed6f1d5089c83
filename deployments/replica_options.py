"""How each deployment's replicas are counted, sized, placed and scaled: the sections `encoder`,
`decoder` and `ingress` of the app's configuration (deployments/config.py)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalingOptions(BaseModel):
    """Ray Serve autoscaling of one deployment, on the deployment's own load signal
    (deployments/autoscaling.py says which). Off when the deployment's `autoscaling` is absent."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="0 only with scale_to_zero: true")
    max_replicas: int = Field(4, ge=1, description="the most replicas the autoscaler starts")
    initial_replicas: int | None = Field(
        None, ge=0, description="None: min_replicas (1 when scaling to zero)"
    )
    scale_to_zero: bool = Field(
        False,
        description="allow min_replicas 0: idle deployments free their GPUs, the first request waits for a "
        "replica to start (model load: seconds to minutes)",
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="how long the load must call for more replicas first"
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="how long the load must call for fewer replicas first"
    )
    metrics_interval_s: float = Field(2.0, gt=0, description="how often replicas report their load")
    look_back_period_s: float = Field(10.0, gt=0, description="the window the reports are averaged over")

    @model_validator(mode="after")
    def _bounds_are_consistent(self) -> "AutoscalingOptions":
        if self.min_replicas == 0 and not self.scale_to_zero:
            raise ValueError(
                "min_replicas is 0 but scale_to_zero is false; set scale_to_zero: true to allow it"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        if (
            self.initial_replicas is not None
            and not self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must lie in [min_replicas, max_replicas]"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed metrics_interval_s "
                f"({self.metrics_interval_s}), or the average holds a single report"
            )
        return self


class ReplicaOptions(BaseModel):
    """Ray resources and queue bounds of one deployment's replicas."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="the fixed replica count when `autoscaling` is absent")
    num_cpus: float = Field(1.0, ge=0, description="logical CPUs Ray reserves for each replica")
    num_gpus: float = Field(
        0.0, ge=0, description="a fraction (e.g. 0.5) lets encoder and decoder share a GPU"
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each replica needs, e.g. {whisper_decoder_node: 1}: on a cluster, "
        "the nodes that declare the resource (`ray start --resources`) are the only ones the replicas are "
        "placed on",
    )
    autoscaling: AutoscalingOptions | None = Field(None, description="absent: num_replicas, fixed")
    drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="on scale-down or redeploy, how long a replica may keep finishing its requests "
        "(and, for an encoder, wait for its staged K/V to be pulled) before it is stopped",
    )
    max_ongoing_requests: int = Field(64, ge=1, description="requests one replica works on at once")
    max_queued_requests: int = Field(
        256, ge=1, description="requests waiting for a replica; beyond it callers get 503 (back-pressure)"
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per replica; None: torch's default"
    )

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class EncoderOptions(ReplicaOptions):
    # Windows queue inside the replica, where interactive ones overtake batch ones; Serve's own queue
    # in front of it is first come, first served.
    max_ongoing_requests: int = Field(512, ge=1, description="windows one encoder replica holds at once")
    max_batch_size: int = Field(8, ge=1, description="most 30 s windows in one encoder forward")
    batch_wait_timeout_ms: float = Field(
        10.0, ge=0, description="how long a batch waits to fill while the decoders have room"
    )
    busy_batch_wait_ms: float = Field(
        50.0,
        ge=0,
        description="how long a batch waits to fill while the decoders are busy: a window then joins a "
        "decode batch of many, so a few milliseconds more cost it little, and a fuller encoder batch "
        "takes less of a shared GPU per window",
    )
    decoder_busy_occupancy: float = Field(
        0.75,
        gt=0,
        description="the decoders are busy when the emptiest replica's running and waiting windows reach "
        "this share of engine.max_num_seqs",
    )
    decoder_load_poll_ms: float = Field(
        100.0,
        gt=0,
        description="how often an encoder reads the decoders' load while it has windows (idle: never)",
    )

    def fill_wait_ms(self, decoder_occupancy: float) -> float:
        """How long a forward waits to fill, given the emptiest decoder's occupancy."""
        busy = decoder_occupancy >= self.decoder_busy_occupancy
        return self.busy_batch_wait_ms if busy else self.batch_wait_timeout_ms

    target_pending_windows: float = Field(
        16.0,
        gt=0,
        description="autoscaling: windows queued or encoding per replica that one replica should carry",
    )


class DecoderOptions(ReplicaOptions):
    max_ongoing_requests: int = Field(
        512, ge=1, description="windows admitted to one decoder's queue at once"
    )
    target_kv_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="autoscaling: the share of a replica's KV blocks its windows (running and "
        "waiting, at their worst-case reservation) should take; above it decoders are added",
    )
    routing_stats_period_s: float = Field(
        1.0,
        gt=0,
        description="how often each replica reports its free KV blocks to the router",
    )
    engine_process: bool = Field(
        False,
        description="run the engine (and, colocated, the encoder) in a process of its own, so that "
        "the replica's handling of Serve's calls never takes the decode loop's interpreter. Off by "
        "default: its decode steps are faster, but a colocated encoder thread then waits behind the "
        "decode loop, and a colocated replica serves fewer tokens a second",
    )
    freeze_start_up_objects: bool = Field(
        True,
        description="once started, leave every object the replica made while starting (weights' "
        "modules, tokenizer, the framework's own) out of Python's full garbage collections, which "
        "otherwise pause the decode loop for milliseconds each (engine/decode/heap.py). Off: every "
        "collection walks them, as a plain Python process does",
    )


class DiarizerOptions(ReplicaOptions):
    """The speaker diarizer (engine/diarize): one deployment for the whole app, since who speaks
    when does not depend on the Whisper model. Its load is requests, each one recording, so it
    scales on Serve's own policy (ongoing requests per replica)."""

    num_cpus: float = Field(1.0, ge=0, description="logical CPUs Ray reserves for each diarizer replica")
    num_gpus: float = Field(
        0.0, ge=0, description="above 0 the speaker encoder runs on CUDA (a fraction shares the GPU)"
    )
    max_ongoing_requests: int = Field(64, ge=1, description="recordings one diarizer replica holds at once")
    max_batch_size: int = Field(
        8, ge=1, description="most recordings whose windows share one call's embedding batches"
    )
    batch_wait_timeout_ms: float = Field(
        10.0, ge=0, description="how long a call waits for more recordings to join it"
    )
    embedding_batch_size: int | None = Field(
        None,
        ge=1,
        description="speaker-embedding windows per forward pass; None: 8 on a CPU (larger batches "
        "outgrow its caches and run slower per window), 64 on a GPU",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each diarizer replica; None: one per logical CPU it "
        "reserves (num_cpus rounded up)",
    )

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"

    @property
    def threads(self) -> int:
        """The speaker encoder's torch threads: the CPUs Ray gives the replica, unless set."""
        return self.torch_threads or max(1, math.ceil(self.num_cpus))
