"""A forward hands each window on as soon as it has it: an encoder whose staging holds fewer windows
than a batch stages the whole batch while a decoder pulls the first ones, instead of waiting on itself."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from deployments.config import parse_app_config
from deployments.window_batcher import WindowBatcher, WindowJob


def _jobs(count: int) -> list[WindowJob]:
    return [WindowJob(f"w{index}", np.zeros(16000, dtype=np.float32)) for index in range(count)]


def _batcher(forward) -> WindowBatcher:
    return WindowBatcher(forward, max_batch_size=4, batch_aging_s=30.0, fill_wait_ms=lambda: 50.0)


def test_a_window_reaches_its_caller_while_the_rest_of_its_batch_is_still_in_the_forward():
    first_received, forward_finished = threading.Event(), threading.Event()

    def forward(jobs):  # the second outcome is made only once the first window's caller has its own
        yield f"{jobs[0].request_id} done"
        assert first_received.wait(10), "the first outcome was held back until the forward ended"
        for job in jobs[1:]:
            yield f"{job.request_id} done"
        forward_finished.set()  # what follows the last outcome runs too

    async def scenario():
        batcher = _batcher(forward)
        calls = [asyncio.ensure_future(batcher.submit(job)) for job in _jobs(4)]
        first = await asyncio.wait_for(calls[0], 10)
        first_received.set()
        return first, await asyncio.wait_for(asyncio.gather(*calls[1:]), 10), batcher

    first, rest, batcher = asyncio.run(scenario())
    assert [first, *rest] == [f"w{index} done" for index in range(4)]
    assert (batcher.batches, batcher.windows_encoded, batcher.num_pending) == (1, 4, 0)
    assert forward_finished.is_set()


def test_a_forward_that_fails_midway_keeps_what_it_handed_on_and_fails_only_the_rest():
    def forward(jobs):
        yield "encoded"
        raise RuntimeError("the device went away")

    def short_forward(jobs):
        return ["encoded"]  # one outcome for a batch of several

    async def scenario(forward_fn):
        batcher = _batcher(forward_fn)
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(job) for job in _jobs(3)), return_exceptions=True), 10
        )
        return outcomes, batcher.num_pending

    outcomes, pending = asyncio.run(scenario(forward))
    assert outcomes[0] == "encoded" and pending == 0
    assert all(isinstance(o, RuntimeError) and "device went away" in str(o) for o in outcomes[1:])
    outcomes, pending = asyncio.run(scenario(short_forward))
    assert outcomes[0] == "encoded" and pending == 0
    assert [str(o) for o in outcomes[1:]] == [
        f"the encoder's forward gave no outcome for w{i}" for i in (1, 2)
    ]


@pytest.mark.slow
def test_an_encoder_batch_larger_than_its_staging_is_staged_whole_while_a_decoder_pulls_it():
    """tiny.en on the CPU, its staging holding fewer windows than its batch of 8. With a decoder
    pulling each window as it arrives the whole batch is staged in one forward; with none pulling,
    the window past what staging holds fails after ``stage_wait_s`` (back-pressure, no hang)."""
    from deployments.encoder import EncoderDeployment, window_layout
    from kv_transfer.base import StagingFullError, TransferHandle
    from kv_transfer.local import LocalReceiver

    config = parse_app_config(
        {
            "engine": {"model": "tiny.en", "device": "cpu"},
            "transfer": {
                "connector": "local",
                "mode": "encoder_states",  # pulled whole (pull_states), no paged cache needed
                "staging_memory_mb": 6,
                "stage_wait_s": 3,
            },
            "encoder": {"max_batch_size": 8, "batch_wait_timeout_ms": 200},
        }
    )
    deployment = EncoderDeployment(config)
    receiver = LocalReceiver(config.transfer, "cpu")
    held = deployment.sender.holds_at_once(
        window_layout(deployment.loaded.weights.dims, config.engine, "encoder_states")
    )
    most_staged = 0

    async def encode_then_pull(job: WindowJob) -> TransferHandle:
        nonlocal most_staged
        handle = await deployment.encode(job)
        most_staged = max(most_staged, deployment.sender.num_staged)
        assert receiver.pull_states(handle).shape[0] == 1500  # what a decoder does: the pull frees it
        return handle

    async def scenario():  # one event loop, as a replica has
        pulled = await asyncio.wait_for(asyncio.gather(*(encode_then_pull(job) for job in _jobs(8))), 60)
        unpulled = await asyncio.wait_for(
            asyncio.gather(*(deployment.encode(job) for job in _jobs(held + 1)), return_exceptions=True), 60
        )
        assert deployment.batcher.windows_encoded == 8 + held + 1  # counted as handed on
        return pulled, deployment.batcher.batches, unpulled

    try:
        assert 1 <= held < 8
        pulled, batches, unpulled = asyncio.run(scenario())
        assert all(isinstance(handle, TransferHandle) for handle in pulled)
        assert batches == 2, "the eight windows were one forward, the unpulled ones another"
        assert most_staged <= held
        assert [isinstance(o, TransferHandle) for o in unpulled] == [True] * held + [False]
        assert isinstance(unpulled[-1], StagingFullError) and "stayed full for 3.0 s" in str(unpulled[-1])
        for handle in unpulled[:held]:
            deployment.sender.release(handle.request_id)
        assert deployment.sender.num_staged == 0
    finally:
        deployment.sender.close()
