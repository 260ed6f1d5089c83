"""The decode loop's own account of where time goes (engine/decode/timings.py): every launched
step and the sequences in it, and each decoded window's wait for admission, for its K/V and its
decoding. /metrics and bench_load.py read these; a wrong sum would send a tuning effort the wrong
way."""

from __future__ import annotations

import time

import pytest

from engine.kv.sources import CrossKVTensor
from engine.types import DecodeOptions
from tests.engine.decode.test_kv_loading import GatedPull
from tests.support.engines import engine_with
from tests.support.speech import short_english_clips


def test_steps_rows_and_window_stages_add_up_to_what_the_loop_did(tiny_en, short_clip_cross_kvs):
    cross_kvs = short_clip_cross_kvs(short_english_clips()[:5])
    engine = engine_with(tiny_en, max_num_seqs=2, block_size=16)
    submitted = time.monotonic()
    requests = [
        engine.make_request(DecodeOptions(max_tokens=6 + i), CrossKVTensor(kv), request_id=str(i))
        for i, kv in enumerate(cross_kvs)
    ]
    for request in requests:
        engine.submit(request)
    step_calls, results = 0, []
    while engine.has_work:
        results += engine.step()
        step_calls += 1
        if step_calls == 2:
            engine.abort("4")  # ends before it is decoded: no stages of its own to count
    wall_s = time.monotonic() - submitted
    timings = engine.stats().timings

    decoded = [r for r in results if r.request_id != "4"]
    assert timings.windows == len(decoded) == 4
    assert 0 < timings.steps <= step_calls
    # Every sampled token took a row of some step, and no step ran more than max_num_seqs rows.
    assert sum(len(r.tokens) for r in decoded) <= timings.rows <= 2 * timings.steps
    # Two windows run at a time: the other two waited for a slot while the first two decoded.
    assert timings.queued_s > 0 and timings.decoding_s > 0
    assert timings.loading_s == 0  # in-process K/V is written at admission
    assert timings.load_queued_s == timings.load_pulling_s == timings.load_landed_s == 0
    assert timings.queued_s + timings.loading_s + timings.decoding_s <= 4 * wall_s
    assert 0 < timings.read_wait_s <= wall_s  # every launched step was read back, within the run


def test_a_window_whose_kv_travels_counts_its_load_apart_from_its_decoding(tiny_en, short_clip_cross_kvs):
    (cross_kv,) = short_clip_cross_kvs(short_english_clips()[:1])
    engine = engine_with(tiny_en, block_size=16)
    # The pull lands 0.3 s after it starts, however long it queued for a worker first.
    pull = GatedPull(CrossKVTensor(cross_kv), opens_after_s=0.3)
    engine.submit(engine.make_request(DecodeOptions(max_tokens=4), pull))
    started = time.monotonic()
    while engine.has_work:
        engine.step()
    wall_s = time.monotonic() - started
    timings = engine.stats().timings
    assert timings.windows == 1
    assert 0.25 <= timings.loading_s <= wall_s
    assert 0 < timings.decoding_s <= wall_s - timings.loading_s
    # Of the load: the pull is what waited (a worker was free; the loop, idle, saw it land at once).
    assert 0.25 <= timings.load_pulling_s <= timings.loading_s
    assert timings.load_queued_s + timings.load_landed_s < 0.1
    parts = timings.load_queued_s + timings.load_pulling_s + timings.load_landed_s
    assert parts == pytest.approx(timings.loading_s)


def test_with_one_loader_worker_a_second_pull_waits_for_the_first_and_counts_it_as_queued(
    tiny_en, short_clip_cross_kvs
):
    cross_kvs = short_clip_cross_kvs(short_english_clips()[:2])
    engine = engine_with(tiny_en, block_size=16, kv_load_workers=1)
    pulls = [GatedPull(CrossKVTensor(kv)) for kv in cross_kvs]
    for i, pull in enumerate(pulls):
        engine.submit(engine.make_request(DecodeOptions(max_tokens=4), pull, request_id=str(i)))
    engine.step()  # admits both: the first pull holds the only worker, the second waits for it
    assert engine.loader.num_loading == 2
    time.sleep(0.3)
    pulls[0].gate.set()
    pulls[1].gate.set()  # opened before the second pull starts: it waited on the worker only
    while engine.has_work:
        engine.step()
    timings = engine.stats().timings
    assert timings.windows == 2
    assert 0.25 <= timings.load_queued_s < timings.loading_s, "the second window queued behind the first"
    assert timings.load_pulling_s >= 0.25, "the first pull waited at its gate"
    parts = timings.load_queued_s + timings.load_pulling_s + timings.load_landed_s
    assert parts == pytest.approx(timings.loading_s)
