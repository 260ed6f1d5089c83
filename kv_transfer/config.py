"""The transfer layer's configuration, validated once at start-up (the app config's `transfer:`)."""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kv_transfer.base import TransferPayload

ConnectorName = Literal["nixl", "object_store", "local"]


def nixl_available() -> bool:
    """Whether a NIXL build is importable here (the `nixl` meta package or one CUDA variant)."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13", "nixl_cu12"))


class TransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    connector: Literal["auto", "nixl", "object_store", "local"] = Field(
        "auto",
        description="nixl: the decoder READs staged blocks into its cache (UCX: CUDA IPC, RDMA, shared "
        "memory); object_store: through Ray's object store; local: encoder and decoder in one process "
        "(a device copy); auto: nixl when importable, else object_store",
    )
    mode: Literal["auto", "cross_kv", "encoder_states"] = Field(
        "auto",
        description="cross_kv: ship every decoder layer's cross-attention K/V; encoder_states: ship the "
        "encoder output and let the decoder project it (64x fewer bytes for large-v3); auto: see "
        "kv_transfer/README.md",
    )
    staging_memory_mb: float = Field(
        1024, gt=0, description="the sender's staging memory, allocated (and registered) once; never grows"
    )
    stage_wait_s: float = Field(
        5.0, ge=0, description="how long staging waits for room when full before raising StagingFullError"
    )
    unclaimed_timeout_s: float = Field(
        120.0,
        gt=0,
        description="staging never pulled within this time is freed; a later pull fails (retriable)",
    )
    pull_timeout_s: float = Field(
        30.0, gt=0, description="longest one pull may take before it fails (retriable)"
    )
    release_poll_interval_ms: float = Field(
        5.0,
        gt=0,
        le=1000,
        description="how often a sender checks for finished pulls and expiry, and an idle NIXL agent makes "
        "progress",
    )
    staged_poll_interval_ms: float = Field(
        0.2,
        gt=0,
        le=1000,
        description="how often a NIXL sender's service thread calls its agent while it holds staged windows "
        "in GPU memory: a READ of them completes only while the sender's agent makes progress, so without "
        "NIXL's progress thread (sender_progress_thread) this bounds a pull's time; "
        "release_poll_interval_ms applies while nothing is staged, and to staging "
        "in host memory, which is read without the sender",
    )

    sender_progress_thread: Literal["auto", "on", "off"] = Field(
        "auto",
        description="NIXL's own progress thread in a sender's agent: a READ of staging in GPU memory "
        "completes only while the sender's agent makes progress, and progress made from Python waits for "
        "the GIL the encoder replica's threads hold. The thread "
        "busy-polls a core. auto: on where the sender stages in GPU memory, off for host memory (read "
        "without the sender)",
    )

    def sender_progress_thread_on(self, device: torch.device) -> bool:
        """Whether a NIXL sender staging on ``device`` runs NIXL's progress thread."""
        if self.sender_progress_thread == "auto":
            return torch.device(device).type == "cuda"
        return self.sender_progress_thread == "on"

    @model_validator(mode="after")
    def _connector_is_installed(self) -> "TransferConfig":
        if self.connector == "nixl" and not nixl_available():
            raise ValueError(
                "connector: nixl, but no NIXL build is importable here; "
                "`pip install nixl-cu13` (or nixl-cu12 for a CUDA 12 torch), or use connector: object_store"
            )
        return self

    def resolved_connector(self) -> ConnectorName:
        if self.connector == "auto":
            return "nixl" if nixl_available() else "object_store"
        return self.connector

    def resolved_mode(self) -> TransferPayload:
        """What ``auto`` ships: the K/V itself where the link is a zero-copy device path (nixl, local),
        the 8-64x smaller encoder states where every byte is serialized and copied (object_store)."""
        if self.mode != "auto":
            return self.mode
        return "encoder_states" if self.resolved_connector() == "object_store" else "cross_kv"
