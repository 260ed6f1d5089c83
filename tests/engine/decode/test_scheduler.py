"""The scheduler's policy on its own: admission, priorities, aging, held blocks and what a read step
appends, with an injected clock (no model, no sleeping)."""

from __future__ import annotations

from engine.decode.request import Request, RequestStatus
from engine.decode.scheduler import LaunchedRows, Scheduler
from engine.decode.step.output import StepOutput
from engine.kv.block_pool import BlockPool
from engine.types import DecodeOptions, FinishReason, Priority, batch_places
from tests.support.clock import FakeClock

BLOCK_SIZE = 16
CROSS_TOKENS = 32  # two cross-attention blocks a request
EOT = 99


def window(request_id: str, priority: Priority = Priority.INTERACTIVE, max_tokens: int = 10) -> Request:
    """A request of 3 prompt tokens: 2 cross blocks + 1 self block of 16 tokens."""
    request = Request(
        request_id=request_id,
        prompt_tokens=[1, 2, 3],
        sot_index=0,
        max_tokens=max_tokens,
        options=DecodeOptions(),
        cross_source=None,
        priority=priority,
    )
    request.pending_tokens = [1]
    return request


def scheduler_with(num_blocks: int, max_num_seqs: int = 8, **policy) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    scheduler = Scheduler(
        BlockPool(num_blocks, BLOCK_SIZE),
        CROSS_TOKENS,
        max_num_seqs,
        2048,
        eot=EOT,
        n_text_ctx=448,
        clock=clock,
        **policy,
    )
    return scheduler, clock


def ids(requests: list[Request]) -> list[str]:
    return [request.request_id for request in requests]


def test_a_request_is_admitted_only_when_the_pool_holds_its_worst_case_and_the_next_waits_in_order():
    scheduler, _ = scheduler_with(num_blocks=7)  # room for two requests of 3 blocks
    for name in ("a", "b", "c"):
        scheduler.add(window(name))
    step = scheduler.schedule()
    assert ids(step.admitted) == ["a", "b"] and ids(step.batch) == ["a", "b"]
    assert scheduler.pool.num_free_blocks == 1
    assert ids(scheduler.waiting) == ["c"], "the third waits for room instead of being dropped"
    scheduler.finish(scheduler.running[0], FinishReason.STOP)
    assert ids(scheduler.schedule().admitted) == ["c"]


def test_the_oldest_interactive_request_is_admitted_before_older_batch_work():
    scheduler, _ = scheduler_with(num_blocks=3)  # one request at a time
    scheduler.add(window("batch", Priority.BATCH))
    scheduler.add(window("interactive"))
    assert ids(scheduler.schedule().admitted) == ["interactive"]


def test_batch_work_that_waited_batch_aging_s_ranks_as_interactive_without_sleeping():
    scheduler, clock = scheduler_with(num_blocks=3, batch_aging_s=5.0)
    scheduler.add(window("batch", Priority.BATCH))
    clock.now_s = 5.0
    scheduler.add(window("interactive"))
    assert ids(scheduler.schedule().admitted) == ["batch"], "aged batch work is older, so it goes first"


def test_admitted_batch_windows_run_at_every_step_beside_interactive_work():
    scheduler, clock = scheduler_with(num_blocks=12, batch_aging_s=5.0)
    scheduler.add(window("batch", Priority.BATCH))
    assert ids(scheduler.schedule().batch) == ["batch"]
    scheduler.add(window("interactive"))
    for now_s in (1.0, 4.9, 5.0):
        clock.now_s = now_s
        assert ids(scheduler.schedule().batch) == ["batch", "interactive"], "nothing admitted is parked"


def test_a_batch_window_under_steady_interactive_load_waits_holding_nothing_and_then_runs_every_step():
    scheduler, clock = scheduler_with(num_blocks=9, max_num_seqs=2, batch_aging_s=1.0)
    batch = window("batch", Priority.BATCH, max_tokens=5)
    scheduler.add(batch)
    steps_run: dict[str, int] = {}
    sent, steps_waiting, batch_steps = 0, 0, []
    for step in range(100):
        while scheduler.num_waiting_of(Priority.INTERACTIVE) < 2:  # interactive work never lets up
            scheduler.add(window(f"i{sent}"))
            sent += 1
        ran = ids(scheduler.schedule().batch)
        if batch.status == RequestStatus.WAITING:
            steps_waiting += 1
            assert batch.blocks.all_ids() == [] and "batch" not in ran
        elif batch.status == RequestStatus.RUNNING:
            assert "batch" in ran, "admitted, it runs at every step"
            batch_steps.append(step)
        for request in list(scheduler.running):
            steps_run[request.request_id] = steps_run.get(request.request_id, 0) + 1
            if steps_run[request.request_id] == (5 if request is batch else 3):
                scheduler.finish(request, FinishReason.LENGTH)
        clock.advance(0.1)
    # Aged after 10 steps, it takes the next slot an interactive window frees (each runs 3 steps).
    assert steps_waiting <= 1.0 / 0.1 + 3, "no starvation: it ranks as interactive once aged"
    assert len(batch_steps) == 5 and batch_steps == list(range(batch_steps[0], batch_steps[0] + 5))
    assert batch.status == RequestStatus.FINISHED and sent > 40


def test_interactive_reserved_seqs_keep_slots_and_blocks_out_of_batch_works_reach():
    scheduler, _ = scheduler_with(num_blocks=30, max_num_seqs=3, interactive_reserved_seqs=1)
    for name in ("b1", "b2", "b3"):
        scheduler.add(window(name, Priority.BATCH))
    assert ids(scheduler.schedule().admitted) == ["b1", "b2"], "one slot stays free for interactive work"
    scheduler.add(window("interactive"))
    assert ids(scheduler.schedule().admitted) == ["interactive"]


def test_a_request_finished_while_its_step_is_on_the_device_keeps_its_blocks_until_that_step_is_read():
    scheduler, _ = scheduler_with(num_blocks=6)
    request = window("a")
    scheduler.add(request)
    scheduler.schedule()
    free_while_running = scheduler.pool.num_free_blocks
    request.launched_in = 4
    scheduler.step_read(3)
    scheduler.finish(request, FinishReason.ABORTED)
    assert request.status == RequestStatus.FINISHED
    assert scheduler.pool.num_free_blocks == free_while_running, "step 4 may still write its K/V"
    scheduler.step_read(4)
    assert scheduler.pool.num_free_blocks == 6


def test_a_read_step_appends_tokens_and_reports_end_of_text_and_length_stops():
    scheduler, _ = scheduler_with(num_blocks=12)
    short, ending, going = window("short", max_tokens=1), window("ending"), window("going")
    for request in (short, ending, going):
        scheduler.add(request)
    batch = scheduler.schedule().batch
    for request in batch:
        request.launched_in, request.unread_tokens = 0, 1
    scheduler.launched[0] = LaunchedRows(requests=batch, epochs=[0, 0, 0], computed_after=[4, 4, 4])
    output = StepOutput(
        step_id=0,
        tokens=[7, EOT, 8],
        logprobs=[-0.5, -0.25, -1.0],
        sampled_rows={0, 1, 2},
        no_speech_probs={1: 0.125},
        languages={},
    )
    stopped = scheduler.update_from_output(output)
    assert [(request.request_id, reason) for request, reason in stopped] == [
        ("short", FinishReason.LENGTH),
        ("ending", FinishReason.STOP),
    ]
    assert short.output_tokens == [7] and ending.output_tokens == [] and going.output_tokens == [8]
    assert going.sum_logprob == -1.0 and ending.no_speech_prob == 0.125


def test_rows_of_a_window_restarted_since_its_step_was_launched_are_ignored():
    scheduler, _ = scheduler_with(num_blocks=6)
    request = window("a")
    scheduler.add(request)
    batch = scheduler.schedule().batch
    scheduler.launched[0] = LaunchedRows(requests=batch, epochs=[0], computed_after=[4])
    request.epoch = 1  # a fallback restart after the step was launched
    output = StepOutput(
        step_id=0,
        tokens=[EOT],
        logprobs=[0.0],
        sampled_rows={0},
        no_speech_probs={},
        languages={},
    )
    assert scheduler.update_from_output(output) == [] and request.output_tokens == []


def test_with_consecutive_cross_blocks_each_window_reads_one_run_of_blocks_after_others_finish():
    """What the CPU's in-place cross-attention asks for: windows admitted after others finished still
    get their cross-attention blocks as one run of consecutive ids, and all blocks come back."""
    scheduler, _ = scheduler_with(num_blocks=12, consecutive_cross_blocks=True)
    names = iter("abcdefgh")
    for _ in range(3):
        scheduler.add(window(next(names)))
    scheduler.schedule()
    for _ in range(3):
        scheduler.finish(scheduler.running[1 if len(scheduler.running) > 1 else 0], FinishReason.STOP)
        scheduler.add(window(next(names)))
        scheduler.schedule()
    assert len(scheduler.running) == 3
    for request in scheduler.running:
        first = request.blocks.cross_block_ids[0]
        assert request.blocks.cross_block_ids == [first, first + 1], request.request_id
    for request in list(scheduler.running):
        scheduler.finish(request, FinishReason.STOP)
    assert scheduler.pool.num_free_blocks == 12


def _a_long_file_under_interactive_saturation(
    batch_share: float, steps: int = 120
) -> tuple[list[int], Request]:
    """Ten slots kept full by interactive windows of 2 to 5 steps, two more always waiting; after
    ten steps a long file's eight windows (six steps each) arrive as batch work. Aging never
    rescues it here. Returns each step's batch rows from the file's arrival, and its last window."""
    scheduler, clock = scheduler_with(
        num_blocks=40, max_num_seqs=10, batch_aging_s=1e9, batch_share=batch_share
    )
    file_windows = [window(f"file{index}", Priority.BATCH) for index in range(8)]
    steps_run: dict[str, int] = {}
    batch_rows, sent = [], 0
    for step in range(steps):
        if step == 10:
            for file_window in file_windows:
                scheduler.add(file_window)
        # Interactive work never lets up: enough for every free slot, and two more.
        while scheduler.num_waiting_of(Priority.INTERACTIVE) < 10 - len(scheduler.running) + 2:
            scheduler.add(window(f"i{sent}"))
            sent += 1
        ran = scheduler.schedule().batch
        assert len(ran) == 10, "saturated: every slot runs a row at every step"
        if step >= 10:
            batch_rows.append(sum(request.priority == Priority.BATCH for request in ran))
        for request in list(scheduler.running):
            steps_run[request.request_id] = steps_run.get(request.request_id, 0) + 1
            length = 6 if request.priority == Priority.BATCH else 2 + int(request.request_id[1:]) % 4
            if steps_run[request.request_id] == length:
                scheduler.finish(request, FinishReason.LENGTH)
        clock.advance(0.1)
    return batch_rows, file_windows[-1]


def test_under_interactive_saturation_a_long_files_windows_keep_batch_share_of_every_steps_rows():
    batch_rows, last_window = _a_long_file_under_interactive_saturation(batch_share=0.2)
    owed = 2  # 0.2 of 10 slots
    ramp = 5  # the longest interactive window: by then the slots it is owed have freed up
    assert last_window.status == RequestStatus.FINISHED
    finished_at = max(step for step, rows in enumerate(batch_rows) if rows) + 1
    # Eight windows of six steps, two at a time, once the ramp is over: the share and no more.
    assert finished_at <= ramp + 8 // owed * 6
    assert all(rows == owed for rows in batch_rows[ramp : finished_at - 6]), batch_rows[:finished_at]
    assert sum(batch_rows[:finished_at]) == 8 * 6
    assert sum(batch_rows[:finished_at]) >= 0.2 * 10 * (finished_at - ramp)
    assert batch_rows[finished_at:] == [0] * (len(batch_rows) - finished_at), "the file is done"


def test_with_no_batch_share_a_long_file_starves_under_interactive_saturation():
    """The same load with batch_share 0: interactive work takes every slot, the file never starts
    (only batch_aging_s would rescue it), so the test above can fail."""
    batch_rows, last_window = _a_long_file_under_interactive_saturation(batch_share=0.0)
    assert sum(batch_rows) == 0 and last_window.status == RequestStatus.WAITING


def test_batch_work_is_owed_its_share_of_slots_rounded_up_but_never_all_of_them():
    assert [batch_places(10, share) for share in (0.0, 0.05, 0.1, 0.2, 0.25, 0.99)] == [0, 1, 1, 2, 3, 9]
    assert batch_places(70, 0.1) == 7, "0.1 * 70 lands a hair above 7; it still rounds up to 7"
    assert batch_places(1, 0.5) == 0, "one slot cannot be shared: batch work relies on aging there"
