"""The one interface a decoder replica calls its engine through, wherever that engine runs.

``DecoderAPI`` has one method per call. ``DecoderService`` (deployments/decoder_service.py)
implements it in the replica's process; ``RemoteDecoder`` implements it across the engine-process
boundary (deployments/engine_process.py), where each call travels as one of the message data classes
below and ``answer`` turns it back into the same method call on the service in the child. The
Serve deployment (deployments/decoder.py) holds a ``DecoderAPI`` and never knows which it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deployments.decoder_stats import DecoderStats
from deployments.encoder import EncoderStats
from deployments.engine_process import EngineProcess
from deployments.window_batcher import WindowJob
from engine.types import DecodeOptions, DecodeResult, Priority
from kv_transfer.base import TransferHandle


class DecoderAPI(Protocol):
    @property
    def alive(self) -> bool:
        """False once the engine can serve no more (its process or loop is gone)."""

    async def check_options(self, options: DecodeOptions) -> None:
        """Raise RequestRejectedError if this model cannot decode with ``options``."""

    async def occupancy(self) -> float:
        """Running and waiting windows over ``max_num_seqs``."""

    async def discard(self, handle: TransferHandle) -> None:
        """Free the staged K/V ``handle`` points at, which no decoder will pull. Best effort."""

    async def decode(self, call: Decode) -> DecodeResult:
        """Decode one window whose cross-attention K/V (or encoder states) the handle points at."""

    async def transcribe_window(self, call: TranscribeWindow) -> DecodeResult:
        """Colocated: encode one window (batched with others waiting) and decode it."""

    async def autoscaling_stats(self) -> dict[str, float]:
        """The figures deployments/autoscaling.py scales decoders by."""

    def routing_stats(self) -> dict[str, int]:
        """The figures deployments/routing.py ranks replicas by (Serve asks from a thread, not
        from the replica's event loop, so this call blocks)."""

    async def encoder_stats(self) -> EncoderStats:
        """Colocated: the in-process encoder's figures."""

    async def stats(self) -> DecoderStats:
        """KV usage, queue depth and the loop's sums, for /metrics."""

    def close(self) -> None:
        """Stop the engine; calls after this fail."""


# ---- the calls, as messages ------------------------------------------------------------------


@dataclass(frozen=True)
class CheckOptions:
    options: DecodeOptions


@dataclass(frozen=True)
class ReadOccupancy:
    pass


@dataclass(frozen=True)
class Discard:
    handle: TransferHandle


@dataclass(frozen=True)
class Decode:
    handle: TransferHandle
    options: DecodeOptions
    audio_duration_s: float | None = None  # how much of the window is audio (word timings look only there)
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class TranscribeWindow:
    job: WindowJob
    options: DecodeOptions
    audio_duration_s: float | None = None
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class ReadAutoscalingStats:
    pass


@dataclass(frozen=True)
class ReadRoutingStats:
    pass


@dataclass(frozen=True)
class ReadEncoderStats:
    pass


@dataclass(frozen=True)
class ReadStats:
    pass


DecoderCall = (
    CheckOptions
    | ReadOccupancy
    | Discard
    | Decode
    | TranscribeWindow
    | ReadAutoscalingStats
    | ReadRoutingStats
    | ReadEncoderStats
    | ReadStats
)


async def answer(api: DecoderAPI, message: DecoderCall):
    """The call ``message`` stands for, made on ``api``: the one place a message becomes a call."""
    match message:
        case CheckOptions(options):
            return await api.check_options(options)
        case ReadOccupancy():
            return await api.occupancy()
        case Discard(handle):
            return await api.discard(handle)
        case Decode():
            return await api.decode(message)
        case TranscribeWindow():
            return await api.transcribe_window(message)
        case ReadAutoscalingStats():
            return await api.autoscaling_stats()
        case ReadRoutingStats():
            return api.routing_stats()
        case ReadEncoderStats():
            return await api.encoder_stats()
        case ReadStats():
            return await api.stats()
    raise TypeError(f"not a decoder call: {message!r}")


class RemoteDecoder:
    """``DecoderAPI`` over an engine in a process of its own: each call a message to the child."""

    def __init__(self, process: EngineProcess):
        self.process = process

    @property
    def ready_info(self) -> str:
        return self.process.ready_info

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def check_options(self, options: DecodeOptions) -> None:
        await self.process.call(CheckOptions(options))

    async def occupancy(self) -> float:
        return await self.process.call(ReadOccupancy())

    async def discard(self, handle: TransferHandle) -> None:
        await self.process.call(Discard(handle))

    async def decode(self, call: Decode) -> DecodeResult:
        return await self.process.call(call)

    async def transcribe_window(self, call: TranscribeWindow) -> DecodeResult:
        return await self.process.call(call)

    async def autoscaling_stats(self) -> dict[str, float]:
        return await self.process.call(ReadAutoscalingStats())

    def routing_stats(self) -> dict[str, int]:
        return self.process.call_blocking(ReadRoutingStats())

    async def encoder_stats(self) -> EncoderStats:
        return await self.process.call(ReadEncoderStats())

    async def stats(self) -> DecoderStats:
        return await self.process.call(ReadStats())

    def close(self) -> None:
        self.process.close()
