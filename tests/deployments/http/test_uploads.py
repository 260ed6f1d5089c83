"""How long a request body may take to arrive: the gap between its parts and its rate, on the
ASGI receive that the multipart parser reads from, with parts that come on a schedule. The whole
server answering 408 over a socket is in tests/deployments/test_serving.py."""

from __future__ import annotations

import asyncio

import pytest

from deployments.http.uploads import _BodyStalled, _BodyTooSlow, _receive_within_limits

GAP_S = 0.4
MIN_BYTES_PER_S = 1000.0


def _client(parts: list[tuple[float, int]]):
    """An ASGI receive for a body sent as (pause before it in seconds, bytes) parts."""
    remaining = list(parts)

    async def receive() -> dict:
        pause_s, size = remaining.pop(0)
        await asyncio.sleep(pause_s)
        return {"type": "http.request", "body": b"x" * size, "more_body": bool(remaining)}

    return receive


async def _read_all(receive) -> int:
    received = 0
    while True:
        message = await receive()
        received += len(message["body"])
        if not message["more_body"]:
            return received


def test_a_steady_body_above_the_rate_arrives_whole_though_it_takes_longer_than_the_gap():
    parts = [(0.05, 100)] * 30  # 2,000 bytes a second for 1.5 s
    receive = _receive_within_limits(_client(parts), GAP_S, MIN_BYTES_PER_S)
    assert asyncio.run(_read_all(receive)) == 3000


def test_a_body_that_trickles_in_under_the_rate_fails_once_its_allowance_is_spent():
    parts = [(0.1, 10)] * 40  # 100 bytes a second, every gap a quarter of the limit
    receive = _receive_within_limits(_client(parts), GAP_S, MIN_BYTES_PER_S)
    with pytest.raises(_BodyTooSlow):
        asyncio.run(_read_all(receive))


def test_a_pause_longer_than_the_gap_is_a_stall_not_a_slow_rate():
    parts = [(0.05, 500), (GAP_S * 2, 500)]
    with pytest.raises(_BodyStalled):
        asyncio.run(_read_all(_receive_within_limits(_client(parts), GAP_S, MIN_BYTES_PER_S)))


def test_without_a_minimum_rate_only_the_gap_counts():
    parts = [(0.1, 10)] * 10  # the trickle above, for a second
    assert asyncio.run(_read_all(_receive_within_limits(_client(parts), GAP_S, 0.0))) == 100
