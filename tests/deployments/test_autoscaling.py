"""Autoscaling on a local multi-node Ray cluster (three raylets on this machine): an encoder-heavy
burst scales encoders and not decoders, a decoder-heavy load scales decoders, both return to one
replica when idle, no request is lost meanwhile, and replicas sit only on their node type.

The scenario is tests/support/autoscaling.py's, with short phases; benchmarks/bench_autoscaling.py
runs it with longer ones and records the run, its plot and benchmarks/results/autoscaling.json.
"""

from __future__ import annotations

import pytest

from tests.support.autoscaling import (
    DECODER,
    ENCODER,
    NODE_RESOURCE,
    run_scenario,
    scenario_config,
    start_app,
    start_cluster,
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def scenario():
    import ray
    from ray import serve

    cluster = start_cluster()
    try:
        # Scale-downs after half of the benchmark's delay: each idle phase waits it out, and the
        # assertions ask only that both sides get back to one replica.
        url = start_app(cluster, scenario_config(downscale_delay_s=3.0))
        yield run_scenario(url, burst_s=28, load_s=42)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_an_encoder_burst_of_short_silent_clips_adds_encoders_and_no_decoders(scenario):
    metrics = scenario.metrics()
    assert metrics["encoder_replicas_max_encoder_burst"] >= 2, scenario.timeline.samples
    assert metrics["decoder_replicas_max_encoder_burst"] == 1, scenario.timeline.samples


def test_a_decoder_load_of_long_dense_speech_adds_decoders(scenario):
    assert scenario.metrics()["decoder_replicas_max_decoder_load"] >= 2, scenario.timeline.samples


def test_both_sides_return_to_one_replica_when_idle(scenario):
    assert scenario.returned_to_one_after_burst, scenario.timeline.samples
    assert scenario.returned_to_one_after_load, scenario.timeline.samples


def test_no_request_is_lost_while_replicas_come_and_go(scenario):
    # The count depends on the machine's other load (47 to 65 seen on the shared 2-core box); the
    # floor only makes sure requests were in flight through both phases' scaling.
    assert scenario.outcome.sent >= 20
    assert scenario.outcome.lost == [] and scenario.outcome.ok == scenario.outcome.sent


def test_replicas_are_placed_only_on_nodes_of_their_type(scenario):
    assert scenario.placement[ENCODER] == {NODE_RESOURCE[ENCODER]}
    assert scenario.placement[DECODER] == {NODE_RESOURCE[DECODER]}
