"""Autoscaling policies: each side scales on the load that limits it.

An encoder replica is limited by windows waiting to be encoded; a decoder replica by its KV pool
(every window holds 12 cross-attention blocks plus its text blocks while it decodes). Serve's
default policy counts requests, which treats a silent 1 s clip and a dense 30 s window alike, so
each side reports its own figures (``record_autoscaling_stats`` on the replica, averaged by Serve
over ``look_back_period_s``) and these policies turn them into a replica count. Serve then applies
min/max replicas and the upscale/downscale delays.

The policies run in Serve's controller, which unpickles them by value: this module imports
nothing from the project.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

# What encoder replicas report.
PENDING_WINDOWS = "pending_windows"  # queued in the replica or in its forward, both priorities
# What decoder replicas report.
KV_DEMAND_BLOCKS = "kv_demand_blocks"  # blocks held by running windows + reservations of waiting ones
KV_TOTAL_BLOCKS = "kv_total_blocks"
INTERACTIVE_WAITING = "interactive_waiting"  # interactive windows not yet admitted


def _sum_over_replicas(ctx: AutoscalingContext, name: str) -> float:
    per_replica = (ctx.aggregated_metrics or {}).get(name, {})
    return float(sum(per_replica.values()))


class EncoderPolicy:
    """Replicas = windows pending (in replicas and queued at the callers' handles) / the windows
    one replica should carry. Interactive and batch windows both count: both take encoder time."""

    def __init__(self, target_pending_windows: float):
        self.target_pending_windows = target_pending_windows

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        pending = _sum_over_replicas(ctx, PENDING_WINDOWS) + (ctx.total_queued_requests or 0.0)
        return pending / self.target_pending_windows, {}


class DecoderPolicy:
    """Replicas = KV blocks the windows need (running ones' blocks, waiting ones' reservations) / the
    blocks a replica should fill. (A decoder replica accepts windows up to its generous
    max_ongoing_requests, so windows wait inside replicas, where their blocks are counted.)

    Both priorities count in the blocks. When slots are kept for interactive work
    (engine.interactive_reserved_seqs > 0), an interactive window waiting for admission means those
    slots are used up: then the policy asks for at least one more replica, whatever the block
    arithmetic says, because interactive latency is what suffers. (Without reserved slots, windows
    wait briefly for a free slot all the time, and that alone is no reason to scale.)
    """

    def __init__(self, target_kv_utilization: float, interactive_slots_reserved: bool):
        self.target_kv_utilization = target_kv_utilization
        self.interactive_slots_reserved = interactive_slots_reserved

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        pool_sizes = list((ctx.aggregated_metrics or {}).get(KV_TOTAL_BLOCKS, {}).values())
        if not pool_sizes or sum(pool_sizes) == 0:
            return ctx.target_num_replicas, {}  # no reports yet: keep what is asked for
        blocks_per_replica = sum(pool_sizes) / len(pool_sizes)
        demand_blocks = _sum_over_replicas(ctx, KV_DEMAND_BLOCKS)
        desired = demand_blocks / (blocks_per_replica * self.target_kv_utilization)
        if self.interactive_slots_reserved and _sum_over_replicas(ctx, INTERACTIVE_WAITING) >= 1.0:
            desired = max(desired, ctx.current_num_replicas + 1)
        return desired, {}
