"""The ingress asks a decoder about a set of decode options once and remembers only what it accepted."""

from __future__ import annotations

import asyncio

import pytest

from deployments.http.option_checks import AcceptedOptions
from engine.errors import RequestRejectedError
from engine.types import DecodeOptions, FallbackOptions


class Decoder:
    """Stands in for the decoder replica's check_options: rejects beams wider than 5."""

    def __init__(self) -> None:
        self.asked: list[DecodeOptions] = []

    async def check_options(self, options: DecodeOptions) -> RequestRejectedError | None:
        self.asked.append(options)
        if options.beam_size > 5:
            return RequestRejectedError("beam_size must be at most 5")
        return None


def test_accepted_options_are_asked_once_and_rejected_ones_every_time():
    decoder = Decoder()
    accepted = AcceptedOptions(decoder.check_options)
    usual = DecodeOptions(fallback=FallbackOptions(), prompt="Glossary: NIXL")

    async def requests() -> None:
        for _ in range(3):
            await accepted.check(DecodeOptions(fallback=FallbackOptions(), prompt="Glossary: NIXL"))
        for _ in range(2):
            with pytest.raises(RequestRejectedError):
                await accepted.check(DecodeOptions(beam_size=8))

    asyncio.run(requests())
    assert decoder.asked == [usual, DecodeOptions(beam_size=8), DecodeOptions(beam_size=8)]


def test_the_least_recently_used_option_sets_are_forgotten_beyond_the_capacity():
    decoder = Decoder()
    accepted = AcceptedOptions(decoder.check_options, capacity=2)
    first, second, third = (DecodeOptions(prompt=f"prompt {i}") for i in range(3))

    async def requests() -> None:
        for options in (first, second, first, third, first, second):
            await accepted.check(options)

    asyncio.run(requests())
    # first was used again before third came, so second was the one forgotten, and asked again.
    assert decoder.asked == [first, second, third, second]
