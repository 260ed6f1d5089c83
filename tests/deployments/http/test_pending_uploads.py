"""Uploads still arriving hold a place of their own, bounded in all and per client address: when
full, the one furthest behind the minimum rate is cut for the newcomer, and a newcomer is refused
only where every pending upload keeps the rate. Over an ASGI receive, a cut ends the body's wait at
once. The whole server under 300 slow uploads is tests/deployments/test_hostile_input.py."""

from __future__ import annotations

import asyncio

import pytest

from deployments.http.pending_uploads import PendingUploads, UploadsFull
from deployments.http.uploads import _BodyCut, _BodyStalled, _receive_within_limits
from tests.support.clock import FakeClock

MIN_BYTES_PER_S = 500.0


def _table(clock, total: int = 4, per_address: int = 2) -> PendingUploads:
    return PendingUploads(total, per_address, MIN_BYTES_PER_S, clock=clock)


def test_a_full_address_cuts_its_own_stalled_upload_for_a_newcomer_and_leaves_others_alone():
    clock = FakeClock()
    table = _table(clock)
    other = table.admit("10.0.0.2")
    stalled, steady = table.admit("10.0.0.1"), table.admit("10.0.0.1")
    clock.advance(2.0)
    stalled.received_bytes, steady.received_bytes = 200, 5000  # 100 and 2500 bytes a second
    newcomer = table.admit("10.0.0.1")
    assert stalled.cut.is_set() and not steady.cut.is_set() and not other.cut.is_set()
    assert len(table) == 3
    table.finish(stalled)  # its request ends after the cut: nothing left to free
    table.finish(newcomer)
    assert len(table) == 2


def test_a_full_table_cuts_the_upload_furthest_behind_the_rate_across_addresses():
    clock = FakeClock()
    table = _table(clock, total=3, per_address=3)
    uploads = [table.admit(f"10.0.0.{index}") for index in range(3)]
    clock.advance(4.0)
    for upload, received in zip(uploads, [1800, 300, 2500]):  # behind by 200, 1700 and none
        upload.received_bytes = received
    table.admit("10.0.0.9")
    assert [upload.cut.is_set() for upload in uploads] == [False, True, False]


def test_a_newcomer_is_refused_only_when_every_pending_upload_keeps_the_rate():
    clock = FakeClock()
    table = _table(clock, total=2, per_address=2)
    first, second = table.admit("10.0.0.1"), table.admit("10.0.0.2")
    clock.advance(1.0)
    first.received_bytes = second.received_bytes = 600
    with pytest.raises(UploadsFull):
        table.admit("10.0.0.3")
    assert not first.cut.is_set() and not second.cut.is_set() and len(table) == 2


def test_a_cut_ends_the_wait_for_the_next_part_at_once():
    async def run() -> None:
        table = _table(FakeClock())
        place = table.admit("10.0.0.1")

        async def never_sends() -> dict:
            await asyncio.sleep(3600)
            return {}

        receive = _receive_within_limits(never_sends, 60.0, 0.0, upload=place)
        waiting = asyncio.ensure_future(receive())
        await asyncio.sleep(0.05)
        place.cut.set()
        with pytest.raises(_BodyCut):
            await asyncio.wait_for(waiting, 1.0)

    asyncio.run(run())


def test_the_first_bytes_wait_is_the_shorter_one_and_later_gaps_the_longer():
    async def run() -> float:
        parts = [(0.05, 100), (0.3, 100)]  # the second pause past the first-byte wait, within the gap

        async def receive() -> dict:
            pause_s, size = parts.pop(0)
            await asyncio.sleep(pause_s)
            return {"type": "http.request", "body": b"x" * size, "more_body": bool(parts)}

        within = _receive_within_limits(receive, 1.0, 0.0, first_gap_s=0.2)
        await within()
        await within()

        async def silent() -> dict:
            await asyncio.sleep(3600)
            return {}

        with pytest.raises(_BodyStalled) as stalled:
            await _receive_within_limits(silent, 1.0, 0.0, first_gap_s=0.2)()
        return stalled.value.waited_s

    assert asyncio.run(run()) == 0.2
