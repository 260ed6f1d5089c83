"""Continuous batching: requests join and leave at every step without changing anyone's tokens,
and every KV block returns to the pool, whatever way a request ends."""

from __future__ import annotations

import pytest
import torch

from engine.decode.engine import DecoderEngine
from engine.decode.request import Request, RequestStatus
from engine.errors import CacheFullError
from engine.kv.block_pool import BlockPool
from engine.kv.sources import CrossKVTensor
from engine.types import DecodeOptions, FinishReason, Priority
from tests.support.clock import FakeClock
from tests.support.engines import (
    engine_with,
    run_to_completion,
    run_to_completion_by_id,
    steps_to_completion,
)
from tests.support.speech import short_english_clips


@pytest.fixture(scope="module")
def cross_kvs(short_clip_cross_kvs) -> list[torch.Tensor]:
    """Cross-attention K/V of 16 different real clips (speech of different lengths), from their
    states encoded once per run (tests/conftest.py)."""
    return short_clip_cross_kvs(short_english_clips()[:16])


@pytest.mark.slow
def test_sixteen_staggered_requests_each_decode_exactly_as_alone(tiny_en, cross_kvs):
    alone_engine = engine_with(tiny_en, block_size=16)
    options = [DecodeOptions(max_tokens=8 + 5 * i) for i in range(16)]  # different lengths too
    alone = {}
    for i, kv in enumerate(cross_kvs):
        alone_engine.submit(alone_engine.make_request(options[i], CrossKVTensor(kv), request_id=str(i)))
        (result,) = run_to_completion(alone_engine)
        alone[str(i)] = result.tokens

    engine = engine_with(tiny_en, block_size=16)
    # Submit two new requests every step, so they join batches that are mid-decode.
    finished, step, next_index, batch_sizes = {}, 0, 0, []
    while next_index < 16 or engine.has_work:
        for _ in range(2):
            if next_index < 16:
                kv = cross_kvs[next_index]
                engine.submit(
                    engine.make_request(options[next_index], CrossKVTensor(kv), request_id=str(next_index))
                )
                next_index += 1
        for result in engine.step():
            finished[result.request_id] = result
        batch_sizes.append(len(engine.scheduler.running))
        step += 1
        assert step < 2000
    assert {k: v.tokens for k, v in finished.items()} == alone
    assert max(batch_sizes) >= 8, "requests should have overlapped"
    assert engine.pool.num_used_blocks == 0


def test_prompts_fed_a_token_a_step_decode_what_one_prompt_step_decodes(tiny_en, cross_kvs):
    """With ``stepped_prompt_tokens`` (on by default where decode steps replay CUDA graphs) every step
    feeds one token per request, prompts included, so steps that admit requests stay replayable."""
    options = [DecodeOptions(max_tokens=6 + 3 * i, timestamps=i % 2 == 1) for i in range(8)]
    outcomes = []
    for stepped in (0, 8):
        engine = engine_with(tiny_en, block_size=16, stepped_prompt_tokens=stepped)
        fed_per_request: list[int] = []
        execute = engine.runner.execute

        def execute_and_note(step, execute=execute, fed=fed_per_request):  # observes what each step feeds
            fed.extend(len(tokens) for tokens in step.tokens)
            return execute(step)

        engine.runner.execute = execute_and_note
        results = {}
        for i, kv in enumerate(cross_kvs[:8]):  # one new request a step, joining a running batch
            engine.submit(engine.make_request(options[i], CrossKVTensor(kv), request_id=str(i)))
            results |= {r.request_id: r for r in engine.step()}
        results |= run_to_completion_by_id(engine)
        assert engine.pool.num_used_blocks == 0
        outcomes.append(({k: (r.tokens, r.no_speech_prob) for k, r in results.items()}, max(fed_per_request)))
    (prompt_steps, most_fed_at_once), (token_steps, most_fed_stepped) = outcomes
    assert most_fed_at_once > 1 and most_fed_stepped == 1
    assert token_steps.keys() == prompt_steps.keys() == {str(i) for i in range(8)}
    for key, (tokens, no_speech) in prompt_steps.items():
        assert token_steps[key][0] == tokens
        assert token_steps[key][1] == pytest.approx(no_speech, abs=1e-5)


@pytest.mark.slow
def test_a_full_pool_queues_requests_instead_of_deadlocking(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, kv_cache_memory_mb=50)  # room for two requests at a time
    per_request = engine.scheduler.blocks_for(engine.make_request(DecodeOptions(), None))
    assert 2 * per_request <= engine.pool.num_blocks < 3 * per_request
    for kv in cross_kvs[:6]:
        engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(kv)))
    peak_running, results = 0, []
    for finished in steps_to_completion(engine):
        results += finished
        peak_running = max(peak_running, len(engine.scheduler.running))
    assert len(results) == 6 and all(r.finish_reason == FinishReason.STOP for r in results)
    assert peak_running == 2
    assert engine.pool.num_used_blocks == 0


def test_a_request_larger_than_the_whole_pool_fails_cleanly(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, kv_cache_memory_mb=10)
    engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(cross_kvs[0]), request_id="big"))
    (result,) = run_to_completion(engine)
    assert result.finish_reason == FinishReason.ERROR and "kv_cache_memory_mb" in result.error
    assert engine.pool.num_used_blocks == 0


def test_cancelled_requests_free_their_blocks_and_others_continue(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)
    for i in range(4):
        engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(cross_kvs[i]), request_id=f"r{i}"))
    engine.step()
    engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.abort("r1")  # running
    engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(cross_kvs[5]), request_id="late"))
    engine.abort("late")  # still waiting in the inbox
    results = {r.request_id: r for r in run_to_completion(engine)}
    assert results["r1"].finish_reason == FinishReason.ABORTED
    assert results["late"].finish_reason == FinishReason.ABORTED
    assert all(results[f"r{i}"].finish_reason == FinishReason.STOP for i in (0, 2, 3))
    assert engine.pool.num_used_blocks == 0


def test_max_tokens_ends_a_request_with_reason_length(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)
    engine.submit(engine.make_request(DecodeOptions(max_tokens=3), CrossKVTensor(cross_kvs[0])))
    (result,) = run_to_completion(engine)
    assert len(result.tokens) == 3 and result.finish_reason == FinishReason.LENGTH


@pytest.mark.slow
def test_seeded_temperature_sampling_is_reproducible_and_differs_from_greedy(tiny_en, cross_kvs):
    engine = engine_with(tiny_en)

    def decode(options):
        engine.submit(engine.make_request(options, CrossKVTensor(cross_kvs[0])))
        (result,) = run_to_completion(engine)
        return result.tokens

    hot = DecodeOptions(temperature=1.0, seed=7, max_tokens=30)
    assert decode(hot) == decode(hot)
    assert decode(hot) != decode(DecodeOptions(max_tokens=30))


def _submit(engine: DecoderEngine, kv: torch.Tensor, request_id: str, priority: Priority) -> Request:
    request = engine.make_request(DecodeOptions(max_tokens=20), CrossKVTensor(kv), request_id=request_id)
    request.priority = priority
    engine.submit(request)
    return request


def _finish_order(engine: DecoderEngine) -> list[str]:
    return [result.request_id for result in run_to_completion(engine)]


def test_interactive_requests_are_admitted_before_batch_requests_that_came_first(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, max_num_seqs=1)  # one at a time: the finish order is the admission order
    for i in range(3):
        _submit(engine, cross_kvs[i], f"batch{i}", Priority.BATCH)
    _submit(engine, cross_kvs[3], "interactive", Priority.INTERACTIVE)
    assert _finish_order(engine) == ["interactive", "batch0", "batch1", "batch2"]


def test_a_batch_request_that_waited_past_its_aging_goes_before_later_interactive_ones(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, max_num_seqs=1, batch_aging_s=0.2)
    engine.scheduler.clock = clock = FakeClock()
    _submit(engine, cross_kvs[0], "running", Priority.INTERACTIVE)
    engine.step()  # admitted: the one slot is taken
    _submit(engine, cross_kvs[1], "old-batch", Priority.BATCH)
    engine.step()  # waits for the slot
    clock.advance(0.3)  # ages past batch_aging_s
    _submit(engine, cross_kvs[2], "new-interactive", Priority.INTERACTIVE)
    order = _finish_order(engine)
    assert order.index("old-batch") < order.index("new-interactive"), order


def test_reserved_slots_admit_an_interactive_request_at_once_behind_a_batch_backlog(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, max_num_seqs=3, interactive_reserved_seqs=1)
    for i in range(5):
        _submit(engine, cross_kvs[i], f"batch{i}", Priority.BATCH)
    engine.step()
    assert len(engine.scheduler.running) == 2, "batch work leaves the reserved slot free"
    _submit(engine, cross_kvs[5], "interactive", Priority.INTERACTIVE)
    engine.step()
    assert "interactive" in [r.request_id for r in engine.scheduler.running]
    results = run_to_completion(engine)
    assert len(results) == 6 and engine.pool.num_used_blocks == 0, "the batch backlog finishes too"


def test_batch_requests_admitted_before_an_interactive_one_keep_decoding_beside_it(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, max_num_seqs=3)
    for i in range(2):
        _submit(engine, cross_kvs[i], f"batch{i}", Priority.BATCH)
    engine.step()
    engine.step()
    _submit(engine, cross_kvs[2], "interactive", Priority.INTERACTIVE)
    engine.step()  # admitted
    for _ in range(3):
        before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        engine.step()
        after = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        assert all(after[k] > before[k] for k in after), "every admitted request runs at every step"
    assert len(run_to_completion(engine)) == 3


def test_under_continuous_interactive_load_a_batch_window_holds_no_blocks_until_admitted_then_runs_every_step(
    tiny_en, cross_kvs
):
    """Two interactive windows always wait for the engine's two slots. The batch window waits holding
    nothing, ranks as interactive once it has waited batch_aging_s, and then decodes at every step."""
    engine = engine_with(tiny_en, max_num_seqs=2, batch_aging_s=0.5, batch_share=0.0)  # aging alone
    engine.scheduler.clock = clock = FakeClock()
    step_s = 0.05
    batch = _submit(engine, cross_kvs[0], "batch", Priority.BATCH)
    interactive, steps_waiting, tokens_after_each_step = [], 0, []
    while batch.finish_reason is None:
        while sum(r.status == RequestStatus.WAITING for r in interactive) < 2:  # submitted, not admitted
            kv = cross_kvs[1 + len(interactive) % 15]
            interactive.append(_submit(engine, kv, f"i{len(interactive)}", Priority.INTERACTIVE))
        engine.step()
        clock.advance(step_s)
        if batch.status == RequestStatus.WAITING:
            steps_waiting += 1
            assert batch.blocks.all_ids() == [], "a waiting batch window holds no blocks"
        else:
            tokens_after_each_step.append(batch.num_computed_tokens)
        assert steps_waiting + len(tokens_after_each_step) < 400
    # Aged after 10 steps, it takes the next slot an interactive window frees (each runs <= 20 steps).
    assert steps_waiting <= 0.5 / step_s + 20, "admitted once aged, though interactive work never stopped"
    running_steps = tokens_after_each_step[:-1]  # the last one is the step it finished in
    assert all(b > a for a, b in zip(running_steps, running_steps[1:])), "once admitted it runs every step"
    assert len(interactive) > 4 and engine.pool.num_used_blocks > 0, "interactive work went on meanwhile"


def _file_steps_under_interactive_saturation(engine: DecoderEngine, cross_kvs, steps: int) -> list[int]:
    """Four slots kept full of interactive windows (real clips, two more always waiting); after five
    steps a long file's three windows arrive as batch work. Each step's count of the file's windows
    that decoded a token, from the file's arrival."""
    engine.scheduler.clock = FakeClock()  # aging never rescues the file here: time stands still
    interactive, file_windows, decoded = [], [], []
    for step in range(steps):
        if step == 5:
            file_windows = [_submit(engine, cross_kvs[i], f"file{i}", Priority.BATCH) for i in range(3)]
        free_slots = 4 - len(engine.scheduler.running)
        while sum(r.status == RequestStatus.WAITING for r in interactive) < free_slots + 2:  # not admitted
            kv = cross_kvs[3 + len(interactive) % 13]
            interactive.append(_submit(engine, kv, f"i{len(interactive)}", Priority.INTERACTIVE))
        before = [window.num_computed_tokens for window in file_windows]
        engine.step()
        if file_windows:
            decoded.append(sum(w.num_computed_tokens > b for w, b in zip(file_windows, before)))
        if file_windows and all(window.finish_reason is not None for window in file_windows):
            break
    return decoded


@pytest.mark.slow
def test_under_interactive_saturation_a_long_files_windows_decode_at_no_less_than_batch_share(
    tiny_en, cross_kvs
):
    engine = engine_with(tiny_en, max_num_seqs=4, batch_share=0.25)  # one slot of four
    decoded = _file_steps_under_interactive_saturation(engine, cross_kvs, steps=400)
    ramp = 20  # an interactive window's most tokens: by then a slot has freed up for the file
    assert len(decoded) < 3 * 20 + ramp + 5, "the file finished, one window at a time beside the rest"
    started = decoded.index(1)
    assert started <= ramp and all(decoded[started:-1]), "from its first slot it decodes at every step"
    assert sum(decoded) >= 0.25 * 4 * (len(decoded) - ramp)


@pytest.mark.slow
def test_with_no_batch_share_a_long_files_windows_wait_behind_interactive_saturation(tiny_en, cross_kvs):
    engine = engine_with(tiny_en, max_num_seqs=4, batch_share=0.0)
    # Past the ramp within which the share gave the file its slot.
    decoded = _file_steps_under_interactive_saturation(engine, cross_kvs, steps=45)
    assert len(decoded) == 40 and sum(decoded) == 0, "starved: only batch_aging_s would let it in"


def test_block_pool_refuses_double_frees_and_over_allocation():
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(3)
    with pytest.raises(CacheFullError):
        pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
