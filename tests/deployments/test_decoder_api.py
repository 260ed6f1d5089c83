"""deployments/decoder_api.py: every call a decoder replica makes of its engine has its message, and
each message, answered in the engine's process, reaches the same method of the engine that the
replica would call in process. The whole path over a real engine process is
tests/deployments/test_colocated.py's."""

from __future__ import annotations

import asyncio
import inspect
import typing

import numpy as np

from deployments.decoder_api import (
    CheckOptions,
    Decode,
    DecoderAPI,
    DecoderCall,
    Discard,
    ReadAutoscalingStats,
    ReadEncoderStats,
    ReadOccupancy,
    ReadRoutingStats,
    ReadStats,
    RemoteDecoder,
    TranscribeWindow,
    answer,
)
from deployments.decoder_service import DecoderService
from deployments.window_batcher import WindowJob
from engine.types import DecodeOptions
from kv_transfer.base import TransferHandle

# The protocol's calls that travel as messages (``alive`` and ``close`` belong to the transport).
TRANSPORT_ONLY = {"alive", "close"}


class Recorder:
    """An engine that answers each call with its own name and arguments."""

    alive = True

    async def check_options(self, options):
        return ("check_options", options)

    async def occupancy(self):
        return ("occupancy",)

    async def discard(self, handle):
        return ("discard", handle)

    async def decode(self, call):
        return ("decode", call)

    async def transcribe_window(self, call):
        return ("transcribe_window", call)

    async def autoscaling_stats(self):
        return ("autoscaling_stats",)

    def routing_stats(self):
        return ("routing_stats",)

    async def encoder_stats(self):
        return ("encoder_stats",)

    async def stats(self):
        return ("stats",)

    def close(self):
        pass


def test_each_message_reaches_the_method_of_its_call():
    handle = TransferHandle.__new__(TransferHandle)  # never read: passed through as it is
    options = DecodeOptions()
    decode = Decode(handle, options, 1.5)
    window = TranscribeWindow(WindowJob("w", np.zeros(16, dtype=np.float32)), options)
    expected: list[tuple[DecoderCall, tuple]] = [
        (CheckOptions(options), ("check_options", options)),
        (ReadOccupancy(), ("occupancy",)),
        (Discard(handle), ("discard", handle)),
        (decode, ("decode", decode)),
        (window, ("transcribe_window", window)),
        (ReadAutoscalingStats(), ("autoscaling_stats",)),
        (ReadRoutingStats(), ("routing_stats",)),
        (ReadEncoderStats(), ("encoder_stats",)),
        (ReadStats(), ("stats",)),
    ]
    assert {type(message) for message, _ in expected} == set(typing.get_args(DecoderCall))
    for message, outcome in expected:
        assert asyncio.run(answer(Recorder(), message)) == outcome


def test_the_engine_in_process_and_the_remote_one_offer_every_call_with_the_interfaces_signature():
    calls = {name for name in dir(DecoderAPI) if not name.startswith("_")}
    assert calls - TRANSPORT_ONLY == {
        "check_options",
        "occupancy",
        "discard",
        "decode",
        "transcribe_window",
        "autoscaling_stats",
        "routing_stats",
        "encoder_stats",
        "stats",
    }
    for implementation in (DecoderService, RemoteDecoder):
        assert isinstance(implementation.alive, property), implementation
        for name in calls - {"alive"}:
            protocol, method = getattr(DecoderAPI, name), getattr(implementation, name)
            assert inspect.signature(protocol) == inspect.signature(method), (implementation, name)
            assert inspect.iscoroutinefunction(protocol) == inspect.iscoroutinefunction(method), name
