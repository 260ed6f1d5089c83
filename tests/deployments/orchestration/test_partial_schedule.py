"""The replica's partial slots as a fair grant: turns that want a partial pass wait, and a slot
that frees goes to the turn longest without one. Sessions over a WebSocket under that schedule:
tests/deployments/http/test_realtime_partials.py."""

from __future__ import annotations

import asyncio

from deployments.orchestration.partial_schedule import PartialSchedule, PassRequest


class Turn:
    """A turn whose partial pass runs until the test lets it end."""

    def __init__(self, name: str, started: list[str], wants: bool = True):
        self.name = name
        self.started = started
        self.wants = wants
        self.passes: list[asyncio.Future] = []

    def start(self) -> asyncio.Task | None:
        if not self.wants:
            return None
        self.started.append(self.name)
        self.passes.append(asyncio.get_running_loop().create_future())
        return asyncio.ensure_future(self.passes[-1])

    def end_pass(self) -> None:
        self.passes[-1].set_result(None)


async def _settle() -> None:
    for _ in range(3):  # a pass's end reaches the schedule by a done callback, a step later
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_the_waiting_turn_longest_without_a_partial_pass():
    async def scenario() -> list[str]:
        schedule, started = PartialSchedule(limit=1), []
        first, recent, stale = Turn("first", started), Turn("recent", started), Turn("stale", started)
        schedule.request(PassRequest(5.0, first.start))  # a slot is free: at once
        schedule.request(PassRequest(4.0, recent.start))
        schedule.request(PassRequest(1.0, stale.start))
        assert (started, schedule.waiting) == (["first"], 2)
        first.end_pass()
        await _settle()
        stale.end_pass()
        await _settle()
        assert (schedule.in_use, schedule.waiting) == (1, 0)
        recent.end_pass()
        await _settle()
        assert schedule.in_use == 0
        return started

    assert asyncio.run(scenario()) == ["first", "stale", "recent"]


def test_a_withdrawn_request_never_starts_and_a_grant_a_turn_no_longer_wants_goes_to_the_next():
    async def scenario() -> list[str]:
        schedule, started = PartialSchedule(limit=1), []
        busy, gone = Turn("busy", started), Turn("gone", started)
        closed, waiting = Turn("closed", started, wants=False), Turn("waiting", started)
        schedule.request(PassRequest(0.0, busy.start))
        gone_request = PassRequest(1.0, gone.start)
        schedule.request(gone_request)
        schedule.request(PassRequest(2.0, closed.start))
        schedule.request(PassRequest(3.0, waiting.start))
        schedule.withdraw(gone_request)  # its turn ended while it waited
        busy.end_pass()
        await _settle()
        assert (schedule.in_use, schedule.waiting) == (1, 0), "closed passed the slot on to waiting"
        return started

    assert asyncio.run(scenario()) == ["busy", "waiting"]
