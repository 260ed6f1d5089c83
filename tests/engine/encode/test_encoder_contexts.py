"""The contexts a live turn's partial passes are encoded over (engine/encode/context.py) come from a
few buckets, and an encoder is ready for each at start-up: a compiled encoder holds a graph per
context, made while the replica starts, so no request waits for a compile (and every window queued
behind it with it).

torch.compile runs here with a backend that counts graphs made and graphs run around torch's own
eager execution: on a CPU the engine does not compile, but what is compiled when is decided by
torch's tracing, which is the same on any device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deployments.config import RealtimeOptions
from engine.config import EngineConfig
from engine.encode.context import WINDOW_FRAMES, context_buckets, context_frames
from engine.encode.runner import EncoderRunner
from engine.model.audio import N_SAMPLES
from engine.model.loading import load_model


def test_every_context_a_partial_pass_is_given_is_one_of_its_settings_buckets():
    for min_s, pad_s, step_s in ((5.0, 1.0, 10), (5.0, 1.0, 1), (0.0, 2.0, 7), (12.0, 0.0, 10)):
        buckets = context_buckets(min_s, pad_s, step_s)
        given = {context_frames(samples, min_s, pad_s, step_s) for samples in range(0, N_SAMPLES + 1, 1600)}
        assert given == set(buckets), (min_s, pad_s, step_s)
        assert buckets == sorted(buckets) and buckets[-1] == WINDOW_FRAMES
    assert context_buckets(5.0, 1.0, 10) == [500, 1000, WINDOW_FRAMES], "10 s, 20 s and the full window"


def test_the_realtime_settings_name_the_shortened_contexts_encoders_prepare_for():
    assert RealtimeOptions().partial_context_frames() == [], "full_window: nothing to prepare"
    assert RealtimeOptions(partial_context="audio").partial_context_frames() == [500, 1000]
    whole_seconds = RealtimeOptions(partial_context="audio", partial_context_step_s=1)
    assert whole_seconds.partial_context_frames() == list(range(250, WINDOW_FRAMES, 50))


@pytest.fixture
def fresh_dynamo():
    """No graph compiled before the test, and none or its settings after it."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    yield
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.reset()


class CountingBackend:
    """A torch.compile backend that runs each graph eagerly, counting graphs made and graphs run,
    and keeping the mel frames each graph was made for."""

    def __init__(self):
        self.compiled = self.runs = 0
        self.mel_frames: list[int | torch.SymInt] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.compiled += 1
        mels = next(node for node in graph.graph.nodes if node.op == "placeholder" and node.name == "l_mels_")
        self.mel_frames.append(mels.meta["example_value"].shape[2])

        def run(*args):
            self.runs += 1
            return graph.forward(*args)

        return run


@pytest.mark.slow
def test_a_compiled_encoder_has_a_graph_for_each_configured_context_from_start_up_and_compiles_in_no_request(
    random_whisper_folder, monkeypatch, fresh_dynamo
):
    """Under a torch that keeps fewer graphs of one function than the warm-up makes (its default
    is a few contexts' worth), past which it would run the encoder uncompiled: the count of graphs
    run would show it. Left to itself, torch would also compile the second context it sees as one
    graph for any number of frames, which full windows could then run too."""
    torch._dynamo.config.recompile_limit = 2
    loaded = load_model(EngineConfig(model=str(random_whisper_folder), dtype="float32"))  # compiled here
    backend = CountingBackend()
    loaded.model.encoder.compile(backend=backend)
    resolve = EngineConfig.gpu_switches
    monkeypatch.setattr(
        EngineConfig, "gpu_switches", lambda self: dataclasses.replace(resolve(self), compile_encoder=True)
    )
    runner = EncoderRunner(loaded, contexts=RealtimeOptions(partial_context="audio").partial_context_frames())
    compiled_at_start_up = backend.compiled
    assert all(isinstance(frames, int) for frames in backend.mel_frames), "no graph for any number of frames"
    assert set(backend.mel_frames) == {1000, 2000, 3000}, "10 s, 20 s and the full window"

    for frames, batch in [(500, 1), (500, 4), (1000, 3), (WINDOW_FRAMES, 3)]:
        runs = backend.runs
        states = runner.encode(torch.zeros(batch, N_SAMPLES), frames)
        assert states.shape[:2] == (batch, frames)
        assert backend.runs == runs + 1, f"{frames} frames, batch {batch}: ran its compiled graph"
    assert backend.compiled == compiled_at_start_up, "no request compiled anything"

    # A context the settings never give is compiled when it comes.
    runner.encode(torch.zeros(2, N_SAMPLES), 750)
    assert backend.compiled == compiled_at_start_up + 1
