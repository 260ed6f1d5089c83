"""Cross-attention K/V that travels (a pull from an encoder replica) loads beside the decode loop: a
slow pull delays only its own window, a failed one fails only its own, and a window that ends while
its K/V is loading gives its blocks back once nothing writes them any more."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineConfig
from engine.encode.runner import EncoderRunner
from engine.errors import RetriableError
from engine.kv.sources import CrossKVTensor, EncoderStates
from engine.model.loading import load_model
from engine.types import DecodeOptions, FinishReason
from tests.support.engines import decode_alone, engine_with, run_to_completion_by_id
from tests.support.speech import short_english_clips, windows_of

OPTIONS = DecodeOptions(max_tokens=40)


@dataclass
class GatedPull:
    """K/V that travels and lands when the test opens the gate (or fails then, with ``error``)."""

    kv: CrossKVTensor
    error: Exception | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    opens_after_s: float | None = None  # the gate opens this long after the pull starts, if set
    travels = True

    @property
    def num_frames(self) -> int:
        return self.kv.num_frames

    def load_into(self, storage, block_ids, project_states) -> None:
        if self.opens_after_s is not None:
            threading.Timer(self.opens_after_s, self.gate.set).start()
        assert self.gate.wait(60), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        self.kv.load_into(storage, block_ids, project_states)

    def discard(self) -> None:
        pass


@pytest.fixture(scope="module")
def cross_kvs(short_clip_cross_kvs) -> list[torch.Tensor]:
    return short_clip_cross_kvs(short_english_clips()[:2])


def step_until_finished(engine, request_id: str, max_steps: int = 1_000) -> dict:
    results = {}
    for _ in range(max_steps):
        results |= {result.request_id: result for result in engine.step()}
        if request_id in results:
            return results
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def test_a_slow_pull_delays_only_its_own_window_which_then_decodes_as_alone(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)
    slow = GatedPull(CrossKVTensor(cross_kvs[0]))
    engine.submit(engine.make_request(OPTIONS, slow, "slow"))
    engine.submit(engine.make_request(OPTIONS, CrossKVTensor(cross_kvs[1]), "local"))
    results = step_until_finished(engine, "local")
    waiting = next(request for request in engine.scheduler.running if request.request_id == "slow")
    assert "slow" not in results and waiting.cross_kv_loading and waiting.num_computed_tokens == 0
    assert engine.pool.num_used_blocks == engine.scheduler.blocks_for(waiting), "it holds its own blocks"
    slow.gate.set()
    results |= run_to_completion_by_id(engine)
    _, alone = decode_alone(engine_with(tiny_en), cross_kvs[0], OPTIONS)
    assert results["slow"].tokens == alone.tokens and results["slow"].finish_reason == alone.finish_reason
    assert engine.pool.num_used_blocks == 0
    stats = engine.stats()
    assert stats.num_kv_loads == 1 and stats.kv_load_p50_s > 0, "the pull is counted and timed"


def test_a_failed_pull_fails_only_its_window_as_retriable_and_frees_its_blocks(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)
    lost = GatedPull(CrossKVTensor(cross_kvs[0]), error=RetriableError("the encoder replica went away"))
    lost.gate.set()
    engine.submit(engine.make_request(OPTIONS, lost, "lost"))
    engine.submit(engine.make_request(OPTIONS, CrossKVTensor(cross_kvs[1]), "local"))
    results = run_to_completion_by_id(engine)
    assert results["lost"].finish_reason == FinishReason.ERROR and results["lost"].retriable
    assert "went away" in results["lost"].error
    _, alone = decode_alone(engine_with(tiny_en), cross_kvs[1], OPTIONS)
    assert results["local"].tokens == alone.tokens
    assert engine.pool.num_used_blocks == 0


def test_a_window_aborted_while_its_kv_loads_keeps_its_blocks_until_the_load_lands(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)
    slow = GatedPull(CrossKVTensor(cross_kvs[0]))
    engine.submit(engine.make_request(OPTIONS, slow, "slow"))
    engine.step()  # admitted: its pull starts
    engine.abort("slow")
    aborted = engine.step()
    assert [result.finish_reason for result in aborted] == [FinishReason.ABORTED]
    assert engine.pool.num_used_blocks > 0, "the pull may still write them"
    assert engine.has_work, "the loop keeps going until the load lands"
    slow.gate.set()
    run_to_completion_by_id(engine)
    assert engine.pool.num_used_blocks == 0 and not engine.has_work


@dataclass
class TravellingStates:
    """Encoder states that load as a pull would: on the loader's worker, projected there."""

    states: torch.Tensor
    travels = True

    @property
    def num_frames(self) -> int:
        return self.states.shape[0]

    def load_into(self, storage, block_ids, project_states) -> None:
        EncoderStates(self.states).load_into(storage, block_ids, project_states)

    def discard(self) -> None:
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_kv_projected_on_the_loaders_stream_decodes_as_kv_written_inline(random_whisper_folder):
    """The loader writes on a stream of its own; the decode steps (replayed CUDA graphs) must wait
    for it on the device, or they read blocks not yet written."""
    loaded = load_model(
        EngineConfig(
            model=str(random_whisper_folder),
            device="cuda",
            dtype="float32",
            block_size=16,
            kv_cache_memory_mb=256,
            max_num_seqs=8,
            gpu={"compile_encoder": False},
        )
    )
    encoder = EncoderRunner(loaded)
    states = encoder.encode(windows_of([clip.path for clip in short_english_clips()[:6]]).cuda())
    inline, pulled = engine_with(loaded), engine_with(loaded)
    for index, window_states in enumerate(states):
        inline.submit(inline.make_request(OPTIONS, EncoderStates(window_states), str(index)))
        pulled.submit(pulled.make_request(OPTIONS, TravellingStates(window_states), str(index)))
    expected, ours = run_to_completion_by_id(inline), run_to_completion_by_id(pulled)
    assert {key: result.tokens for key, result in ours.items()} == {
        key: result.tokens for key, result in expected.items()
    }
    assert pulled.pool.num_used_blocks == 0
