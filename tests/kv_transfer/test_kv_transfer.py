"""The transfer layer between two real processes: an encoder-side Ray actor stages, this process
pulls into a real paged cache (BlockPool + PagedKVStorage, or the DecoderEngine itself).

Bytes arrive bit for bit whatever the layout (fp8 too); staging is bounded and released; every way
a pull can fail fails retriably with no block and no staging left held; both transfer modes decode
real speech to the same tokens as the in-process engine, with an fp8 KV cache too.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.encode.runner import EncoderRunner
from engine.kv.block_pool import BlockPool
from engine.kv.sources import CrossKVTensor
from engine.kv.storage import PagedKVStorage, split_into_blocks
from engine.model.loading import load_model
from engine.types import DecodeOptions, FinishReason
from kv_transfer import make_receiver, make_sender
from kv_transfer.base import (
    IncompatibleHandleError,
    KVReceiver,
    KVSender,
    StagingFullError,
    TransferError,
    TransferHandle,
)
from kv_transfer.config import TransferConfig
from kv_transfer.source import TransferredCrossKV
from tests.support.engines import run_to_completion_by_id
from tests.support.local_ray import local_ray
from tests.support.speech import SPEECH_DIR, windows_of

CLIPS = ["jfk.flac", "osr72_01.flac", "tts_03.flac"]
TINY_EN_CROSS_KV = (4, 2, 1500, 6, 64)  # tiny.en: decoder layers, k|v, frames, heads, head_dim
UNCLAIMED_TIMEOUT_S = 1.5


def random_layouts(count: int, seed: int = 0) -> list[tuple]:
    """(layers, heads, head_dim, frames, block_size, dtype): tiny.en's, then random ones."""
    rng = random.Random(seed)
    layouts = [(4, 6, 64, 1500, 128, torch.float32)]
    for _ in range(count):
        layouts.append(
            (
                rng.randint(1, 6),
                rng.randint(1, 8),
                rng.choice([8, 16, 64]),
                rng.randint(1, 1500),
                rng.choice([1, 4, 8, 32, 64]),
                rng.choice([torch.float32, torch.bfloat16, torch.float16]),
            )
        )
    return layouts


# ... and tiny.en's in an fp8 KV cache (engine.kv_cache_dtype: fp8_e4m3).
LAYOUTS = [*random_layouts(3), (4, 6, 64, 1500, 16, torch.float8_e4m3fn)]
BLOCK = EngineConfig().block_size  # the engines here use the default; their senders must match
WINDOW_BLOCKS = -(-1500 // BLOCK)
BLOCK_SIZES = sorted({layout[4] for layout in LAYOUTS} | {BLOCK})


def transfer_config(connector: str, **overrides) -> TransferConfig:
    return TransferConfig(
        **{"connector": connector, "staging_memory_mb": 128, "release_poll_interval_ms": 2, **overrides}
    )


def to_actor(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """torch (2.13) cannot unpickle an fp8 tensor, so payloads go to the encoder actor as bytes and a dtype
    name. (Serve never pickles one: the encoder stages its own K/V, handles carry only the dtype name.)"""
    return tensor.view(torch.uint8), str(tensor.dtype).removeprefix("torch.")


def from_test(payload: tuple[torch.Tensor, str]) -> torch.Tensor:
    raw, dtype = payload
    return raw.view(getattr(torch, dtype))


@ray.remote(num_cpus=0)
class EncoderSide:
    """An encoder replica's half in its own process: real senders, and the real encoder."""

    def __init__(self):
        self.senders: dict[str, KVSender] = {}
        self.encoders: dict[str, EncoderRunner] = {}  # by engine.kv_cache_dtype

    def add_sender(self, key: str, config: TransferConfig, block_size: int) -> None:
        self.senders[key] = make_sender(config, block_size=block_size)

    def stage(
        self, key: str, request_id: str, payload: tuple[torch.Tensor, str], kind: str
    ) -> TransferHandle:
        return self.senders[key].stage(request_id, from_test(payload), kind)

    def release(self, key: str, request_id: str) -> None:
        self.senders[key].release(request_id)

    def close_sender(self, key: str) -> None:
        self.senders.pop(key).close()

    def threads_a_new_sender_starts(self, config: TransferConfig, block_size: int, tries: int = 3) -> int:
        """How many threads this process gains with a new sender: the fewest over a few senders
        (made and closed in turn), as other threads (Ray's, UCX's first) may start meanwhile."""
        gained = []
        for _ in range(tries):
            before = len(os.listdir("/proc/self/task"))
            sender = make_sender(config, block_size=block_size)
            gained.append(len(os.listdir("/proc/self/task")) - before)
            sender.close()
            del sender  # its agent, and a progress thread, end now rather than during the next count
            gc.collect()
        return min(gained)

    def num_staged(self, key: str) -> int:
        return self.senders[key].num_staged

    def pid(self) -> int:
        return os.getpid()

    def encode_and_stage(
        self, key: str, audio: torch.Tensor, kv_cache_dtype: str = "auto"
    ) -> dict[str, list[TransferHandle]]:
        """Encode a batch of windows as an encoder replica does; stage it in both modes."""
        if kv_cache_dtype not in self.encoders:
            config = EngineConfig(model="tiny.en", kv_cache_dtype=kv_cache_dtype)
            self.encoders[kv_cache_dtype] = EncoderRunner(load_model(config))
        encoder = self.encoders[kv_cache_dtype]
        states = encoder.encode(audio)
        cross_kv = encoder.cross_kv(states)
        sender = self.senders[key]
        return {
            "cross_kv": [sender.stage(f"kv-{i}", kv, "cross_kv") for i, kv in enumerate(cross_kv)],
            "encoder_states": [
                sender.stage(f"states-{i}", s, "encoder_states") for i, s in enumerate(states)
            ],
        }


@dataclass
class Stager:
    """Stages through a real sender: one in an encoder actor's process, or (local) in this one."""

    actor: Any = None
    key: str = ""
    sender: KVSender | None = None

    def stage(self, request_id: str, payload: torch.Tensor, kind: str = "cross_kv") -> TransferHandle:
        if self.sender is not None:
            return self.sender.stage(request_id, payload, kind)
        return ray.get(self.actor.stage.remote(self.key, request_id, to_actor(payload), kind))

    def release(self, request_id: str) -> None:
        if self.sender is not None:
            return self.sender.release(request_id)
        ray.get(self.actor.release.remote(self.key, request_id))

    def num_staged(self) -> int:
        if self.sender is not None:
            return self.sender.num_staged
        return ray.get(self.actor.num_staged.remote(self.key))


@pytest.fixture(scope="module")
def ray_session():
    # Ship this module's actor class by value: the workers cannot import tests/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # The run's local Ray, as the serving modules before this one left it (tests/support/local_ray.py):
    # no Ray of its own to start and stop. It stays up for the next module, or tests/conftest.py
    # stops it after the last one.
    local_ray()


@pytest.fixture(scope="module")
def encoder_side(ray_session):
    """One encoder process with a nixl and an object_store sender per block size (key
    "<connector>-<block size>"), and ones whose unclaimed staging expires soon ("<connector>-expiring")."""
    actor = EncoderSide.remote()
    for connector in ("nixl", "object_store"):
        for block_size in BLOCK_SIZES:
            ray.get(
                actor.add_sender.remote(f"{connector}-{block_size}", transfer_config(connector), block_size)
            )
        expiring = transfer_config(connector, unclaimed_timeout_s=UNCLAIMED_TIMEOUT_S)
        ray.get(actor.add_sender.remote(f"{connector}-expiring", expiring, BLOCK))
    return actor


@pytest.fixture
def stager(encoder_side):
    """stager(connector, key) -> a Stager; local senders (this process) are closed afterwards."""
    local_senders = []

    def make(connector: str, key: str = str(BLOCK), block_size: int = BLOCK) -> Stager:
        if connector == "local":
            overrides = {"unclaimed_timeout_s": UNCLAIMED_TIMEOUT_S} if key == "expiring" else {}
            local_senders.append(make_sender(transfer_config("local", **overrides), block_size=block_size))
            return Stager(sender=local_senders[-1])
        return Stager(actor=encoder_side, key=f"{connector}-{key}")

    yield make
    for sender in local_senders:
        sender.close()


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def storage_for_windows(windows: int) -> PagedKVStorage:
    """A host cache with room for ``windows`` tiny.en windows, window i in blocks_of_window(i)."""
    return PagedKVStorage(windows * WINDOW_BLOCKS, 4, BLOCK, 6, 64, torch.float32, torch.device("cpu"))


def blocks_of_window(index: int) -> list[int]:
    return list(range(index * WINDOW_BLOCKS, (index + 1) * WINDOW_BLOCKS))


def engine_for(tiny_en) -> DecoderEngine:
    return DecoderEngine(tiny_en, EngineConfig(model="tiny.en", kv_cache_memory_mb=48))


def engine_and_receiver(tiny_en, connector: str) -> tuple[DecoderEngine, KVReceiver]:
    engine = engine_for(tiny_en)
    return engine, make_receiver(transfer_config(connector), storage=engine.runner.storage)


# --- contents --------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store", "local"])
@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}x{x[2]}-{x[3]}frames-bs{x[4]}-{str(x[5])[6:]}"
)
def test_pulled_blocks_equal_the_staged_ones_bit_for_bit(connector, layout, stager):
    layers, heads, head_dim, frames, block_size, dtype = layout
    payload = torch.randn(layers, 2, frames, heads, head_dim).to(dtype)
    num_blocks = -(-frames // block_size) + 7
    storage = PagedKVStorage(num_blocks, layers, block_size, heads, head_dim, dtype, torch.device("cpu"))
    pool = BlockPool(num_blocks, block_size)
    receiver = make_receiver(transfer_config(connector), storage=storage)
    staging = stager(connector, str(block_size), block_size)
    handle = staging.stage("r", payload)
    assert staging.num_staged() == 1

    # Scattered, shuffled block ids, as a busy pool hands them out.
    all_ids = pool.allocate(num_blocks)
    random.Random(frames).shuffle(all_ids)
    block_ids, spare = all_ids[: handle.layout.num_blocks], all_ids[handle.layout.num_blocks :]
    pool.free(spare)
    receiver.pull_blocks(handle, storage, block_ids)

    expected = split_into_blocks(payload, block_size)
    assert torch.equal(as_bytes(storage.read_blocks(block_ids)), as_bytes(expected))
    assert not as_bytes(storage.read_blocks(spare)).any(), "a pull wrote outside its blocks"
    pool.free(block_ids)
    assert pool.num_used_blocks == 0
    assert wait_until(lambda: staging.num_staged() == 0), "the sender kept staging after the pull"
    receiver.close()


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store", "local"])
def test_encoder_states_arrive_bit_for_bit(connector, stager):
    states = torch.randn(1500, 384).to(torch.bfloat16)
    receiver = make_receiver(transfer_config(connector))
    staging = stager(connector)
    pulled = receiver.pull_states(staging.stage("s", states, "encoder_states"))
    assert pulled.shape == (1500, 384) and pulled.dtype == torch.bfloat16
    assert torch.equal(as_bytes(pulled), as_bytes(states))
    assert wait_until(lambda: staging.num_staged() == 0)
    receiver.close()


@pytest.mark.ray
def test_nixl_pulls_from_several_threads_run_side_by_side_and_each_lands_bit_for_bit(stager):
    """A decoder's loader pulls several windows at once: each pull waits for its READs outside the
    agent's lock, with a header slot of its own, so the pulls overlap and none reads another's
    token or bytes."""
    windows = 6
    storage = storage_for_windows(windows)
    receiver = make_receiver(transfer_config("nixl"), storage=storage)
    staging = stager("nixl")
    payloads = [torch.randn(TINY_EN_CROSS_KV) for _ in range(windows)]
    handles = [staging.stage(f"r{index}", payload) for index, payload in enumerate(payloads)]

    reads_in_flight, most_in_flight, counting = 0, 0, threading.Lock()
    read = receiver._read

    def counted_read(*args, **kwargs):  # a spy: the real READ runs, counted while it is in flight
        nonlocal reads_in_flight, most_in_flight
        with counting:
            reads_in_flight += 1
            most_in_flight = max(most_in_flight, reads_in_flight)
        try:
            return read(*args, **kwargs)
        finally:
            with counting:
                reads_in_flight -= 1

    receiver._read = counted_read
    start = threading.Barrier(windows)

    def pull(index: int) -> list[int]:
        block_ids = blocks_of_window(index)
        start.wait()
        receiver.pull_blocks(handles[index], storage, block_ids)
        return block_ids

    with ThreadPoolExecutor(max_workers=windows) as pullers:
        landed = list(pullers.map(pull, range(windows)))
    for payload, block_ids in zip(payloads, landed):
        expected = split_into_blocks(payload, BLOCK)
        assert torch.equal(as_bytes(storage.read_blocks(block_ids)), as_bytes(expected))
    assert most_in_flight >= 2, "the pulls ran one at a time"
    assert wait_until(lambda: staging.num_staged() == 0), "the sender kept staging after the pulls"
    receiver.close()


@pytest.mark.ray
def test_a_nixl_sender_running_nixls_progress_thread_hands_out_windows_bit_for_bit_and_frees_them(
    encoder_side,
):
    """On a GPU a sender's agent runs NIXL's own progress thread (READs of GPU staging complete only
    while the sender makes progress); here, on host memory, the thread is asked for by name."""
    gained = {
        switch: ray.get(
            encoder_side.threads_a_new_sender_starts.remote(
                transfer_config("nixl", staging_memory_mb=8, sender_progress_thread=switch), BLOCK
            )
        )
        for switch in ("off", "on")
    }
    assert gained["on"] == gained["off"] + 1, "NIXL's progress thread did not start"
    key = "nixl-progress-thread"
    ray.get(encoder_side.add_sender.remote(key, transfer_config("nixl", sender_progress_thread="on"), BLOCK))
    staging = Stager(actor=encoder_side, key=key)
    windows = 3
    storage = storage_for_windows(windows)
    receiver = make_receiver(transfer_config("nixl"), storage=storage)
    try:
        payloads = [torch.randn(TINY_EN_CROSS_KV) for _ in range(windows)]
        handles = [staging.stage(f"r{index}", payload) for index, payload in enumerate(payloads)]
        for index, (payload, handle) in enumerate(zip(payloads, handles)):
            block_ids = blocks_of_window(index)
            receiver.pull_blocks(handle, storage, block_ids)
            expected = split_into_blocks(payload, BLOCK)
            assert torch.equal(as_bytes(storage.read_blocks(block_ids)), as_bytes(expected))
        assert wait_until(lambda: staging.num_staged() == 0), "the sender kept staging after the pulls"
    finally:
        receiver.close()
        ray.get(encoder_side.close_sender.remote(key))  # its thread busy-polls a core: not for long


def test_a_sender_runs_nixls_progress_thread_where_it_stages_in_gpu_memory_unless_told():
    on_gpu, on_host = torch.device("cuda", 0), torch.device("cpu")
    automatic = TransferConfig()
    assert automatic.sender_progress_thread_on(on_gpu) and not automatic.sender_progress_thread_on(on_host)
    assert TransferConfig(sender_progress_thread="on").sender_progress_thread_on(on_host)
    assert not TransferConfig(sender_progress_thread="off").sender_progress_thread_on(on_gpu)


# --- failures: retriable, nothing held on either side ----------------------------------------


def decode_expecting_transfer_error(engine: DecoderEngine, receiver, handle: TransferHandle) -> None:
    engine.submit(
        engine.make_request(DecodeOptions(), TransferredCrossKV(handle, receiver), request_id="doomed")
    )
    (result,) = run_to_completion_by_id(engine).values()
    assert result.finish_reason == FinishReason.ERROR
    assert result.retriable, result.error
    assert engine.pool.num_used_blocks == 0
    block_ids = engine.pool.allocate(handle.layout.num_blocks)
    with pytest.raises(TransferError):  # and directly: it is the transfer that fails
        receiver.pull_blocks(handle, engine.runner.storage, block_ids)
    engine.pool.free(block_ids)


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store"])
def test_pull_from_a_killed_sender_fails_retriably_and_holds_no_blocks(connector, tiny_en, ray_session):
    doomed = EncoderSide.remote()
    ray.get(doomed.add_sender.remote("s", transfer_config(connector), BLOCK))
    handle = Stager(doomed, "s").stage("r", torch.randn(TINY_EN_CROSS_KV))
    pid = ray.get(doomed.pid.remote())
    ray.kill(doomed)
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}")), "the killed sender's process lives on"
    decode_expecting_transfer_error(*engine_and_receiver(tiny_en, connector), handle)


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store", "local"])
def test_a_handle_never_claimed_expires_and_then_fails_retriably(connector, tiny_en, stager):
    engine, receiver = engine_and_receiver(tiny_en, connector)
    staging = stager(connector, "expiring")
    started = time.monotonic()
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV))
    assert staging.num_staged() == 1 or time.monotonic() - started > UNCLAIMED_TIMEOUT_S
    assert wait_until(lambda: staging.num_staged() == 0), "unclaimed staging was never freed"
    decode_expecting_transfer_error(engine, receiver, handle)
    assert staging.num_staged() == 0


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store", "local"])
def test_a_pull_after_the_sender_released_fails_retriably(connector, tiny_en, stager):
    engine, receiver = engine_and_receiver(tiny_en, connector)
    staging = stager(connector)
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV))
    staging.release("r")
    assert staging.num_staged() == 0
    decode_expecting_transfer_error(engine, receiver, handle)


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store", "local"])
def test_a_request_aborted_before_admission_frees_its_staging_at_once(connector, tiny_en, stager):
    """Not at unclaimed_timeout_s (120 s here): the engine discards the handle it never pulled."""
    engine, receiver = engine_and_receiver(tiny_en, connector)
    staging = stager(connector)
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV))
    assert staging.num_staged() == 1
    engine.submit(
        engine.make_request(DecodeOptions(), TransferredCrossKV(handle, receiver), request_id="gone")
    )
    engine.abort("gone")  # the caller went away before the decoder admitted the window
    (result,) = run_to_completion_by_id(engine).values()
    assert result.finish_reason == FinishReason.ABORTED
    assert engine.pool.num_used_blocks == 0
    assert wait_until(lambda: staging.num_staged() == 0, timeout_s=5.0), (
        "the aborted window's staging is still held"
    )
    with pytest.raises(TransferError):  # and the handle is dead: nothing can read it any more
        receiver.pull_blocks(handle, engine.runner.storage, engine.pool.allocate(handle.layout.num_blocks))
    receiver.close()


@pytest.mark.ray
def test_a_replayed_handle_never_reads_the_region_reused_by_the_next_request(stager):
    storage = PagedKVStorage(2 * WINDOW_BLOCKS, 4, BLOCK, 6, 64, torch.float32, torch.device("cpu"))
    receiver = make_receiver(transfer_config("nixl"), storage=storage)
    staging = stager("nixl")
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV))
    receiver.pull_blocks(handle, storage, list(range(WINDOW_BLOCKS)))
    assert wait_until(lambda: staging.num_staged() == 0)
    reusing = staging.stage("next", torch.randn(TINY_EN_CROSS_KV))
    assert reusing.location.payload_address == handle.location.payload_address  # first fit
    with pytest.raises(TransferError, match="released before the pull"):
        receiver.pull_blocks(handle, storage, list(range(WINDOW_BLOCKS, 2 * WINDOW_BLOCKS)))
    staging.release("next")
    receiver.close()


@pytest.mark.ray
def test_blocks_of_another_block_size_are_refused_and_their_staging_released(stager):
    storage = PagedKVStorage(2 * WINDOW_BLOCKS, 4, BLOCK // 2, 6, 64, torch.float32, torch.device("cpu"))
    receiver = make_receiver(transfer_config("nixl"), storage=storage)
    staging = stager("nixl")
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV))
    with pytest.raises(IncompatibleHandleError, match="block_size"):
        receiver.pull_blocks(handle, storage, list(range(WINDOW_BLOCKS)))
    assert wait_until(lambda: staging.num_staged() == 0)
    receiver.close()


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["local", "object_store"])
@pytest.mark.parametrize(
    "staged_dtype, cache_dtype", [(torch.float8_e4m3fn, torch.float32), (torch.float32, torch.float8_e4m3fn)]
)
def test_blocks_of_another_kv_cache_dtype_are_refused_naming_it_and_their_staging_released(
    connector, staged_dtype, cache_dtype, stager
):
    storage = PagedKVStorage(2 * WINDOW_BLOCKS, 4, BLOCK, 6, 64, cache_dtype, torch.device("cpu"))
    receiver = make_receiver(transfer_config(connector), storage=storage)
    staging = stager(connector)
    handle = staging.stage("r", torch.randn(TINY_EN_CROSS_KV).to(staged_dtype))
    with pytest.raises(IncompatibleHandleError, match="kv_cache_dtype") as refusal:
        receiver.pull_blocks(handle, storage, list(range(WINDOW_BLOCKS)))
    assert "float8_e4m3fn" in str(refusal.value) and "float32" in str(refusal.value)
    assert not storage.cache.view(torch.uint8).any(), "a refused pull wrote into the cache"
    assert wait_until(lambda: staging.num_staged() == 0)
    receiver.close()


# --- back-pressure ---------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store"])
def test_full_staging_pushes_back_then_admits_once_a_pull_frees_room(connector, ray_session):
    payload = torch.randn(4, 2, 256, 8, 16)  # 1 MiB
    entry_mb = (payload.numel() * 4 + 256) / 2**20
    actor = EncoderSide.remote()
    config = transfer_config(connector, staging_memory_mb=2.5 * entry_mb, stage_wait_s=1.0)
    ray.get(actor.add_sender.remote("s", config, 16))
    staging = Stager(actor, "s")
    first = staging.stage("a", payload)
    staging.stage("b", payload)

    started = time.monotonic()
    with pytest.raises(StagingFullError):
        staging.stage("c", payload)
    assert time.monotonic() - started >= 0.95, "gave up before the configured wait"
    assert staging.num_staged() == 2

    storage = PagedKVStorage(16, 4, 16, 8, 16, torch.float32, torch.device("cpu"))
    receiver = make_receiver(transfer_config(connector), storage=storage)
    waiting = actor.stage.remote("s", "c", to_actor(payload), "cross_kv")  # waits for room ...
    time.sleep(0.2)
    receiver.pull_blocks(first, storage, list(range(16)))
    ready, _ = ray.wait([waiting], timeout=5)  # ... and gets it once a pull frees some
    assert ready, "staging stayed full after a pull released room"
    assert isinstance(ray.get(waiting), TransferHandle)
    assert staging.num_staged() == 2
    receiver.close()
    ray.kill(actor)


# --- both modes, real speech, end to end -----------------------------------------------------


@pytest.fixture(scope="module")
def speech_windows() -> torch.Tensor:
    return windows_of([SPEECH_DIR / clip for clip in CLIPS])


@pytest.fixture(scope="module")
def in_process_tokens(tiny_en, speech_windows) -> list[list[int]]:
    """The reference: the engine decoding cross K/V computed in this process (no transfer)."""
    encoder = EncoderRunner(tiny_en)
    engine = engine_for(tiny_en)
    for i, kv in enumerate(encoder.cross_kv(encoder.encode(speech_windows))):
        engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(kv), request_id=str(i)))
    results = run_to_completion_by_id(engine)
    return [results[str(i)].tokens for i in range(len(CLIPS))]


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store"])
def test_both_modes_decode_real_speech_to_the_in_process_tokens(
    connector, tiny_en, encoder_side, speech_windows, in_process_tokens
):
    handles = ray.get(encoder_side.encode_and_stage.remote(f"{connector}-{BLOCK}", speech_windows))
    engine = engine_for(tiny_en)
    receiver = make_receiver(transfer_config(connector), storage=engine.runner.storage)
    for mode, mode_handles in handles.items():
        for handle in mode_handles:
            assert handle.layout.payload == mode
            engine.submit(
                engine.make_request(
                    DecodeOptions(), TransferredCrossKV(handle, receiver), request_id=handle.request_id
                )
            )
    results = run_to_completion_by_id(engine)

    assert tiny_en.tokenizer.decode(in_process_tokens[0]).strip().startswith("And so my fellow Americans")
    for i, expected in enumerate(in_process_tokens):
        assert results[f"kv-{i}"].tokens == expected, f"cross_kv mode, clip {CLIPS[i]}"
        assert results[f"states-{i}"].tokens == expected, f"encoder_states mode, clip {CLIPS[i]}"
    assert engine.pool.num_used_blocks == 0
    assert wait_until(lambda: Stager(encoder_side, f"{connector}-{BLOCK}").num_staged() == 0)


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl", "object_store"])
def test_an_fp8_cache_ships_half_a_bf16_windows_bytes_and_decodes_to_the_in_process_fp8_tokens(
    connector, tiny_en, encoder_side, speech_windows
):
    # tiny.en's weights with an fp8 cache on both sides, as one app config's engine section gives them.
    fp8 = dataclasses.replace(tiny_en, config=EngineConfig(model="tiny.en", kv_cache_dtype="fp8_e4m3"))
    encoder = EncoderRunner(fp8)
    engine = DecoderEngine(
        fp8, EngineConfig(model="tiny.en", kv_cache_dtype="fp8_e4m3", kv_cache_memory_mb=48)
    )
    cross_kv = encoder.cross_kv(encoder.encode(speech_windows[:1]))[0]
    assert cross_kv.dtype == torch.float8_e4m3fn
    engine.submit(engine.make_request(DecodeOptions(), CrossKVTensor(cross_kv), request_id="in-process"))
    expected = run_to_completion_by_id(engine)["in-process"].tokens
    assert tiny_en.tokenizer.decode(expected).strip().startswith("And so my fellow Americans")

    handles = ray.get(
        encoder_side.encode_and_stage.remote(f"{connector}-{BLOCK}", speech_windows[:1], "fp8_e4m3")
    )
    (kv_handle,), (states_handle,) = handles["cross_kv"], handles["encoder_states"]
    assert kv_handle.layout.dtype == "float8_e4m3fn" and kv_handle.layout.torch_dtype == torch.float8_e4m3fn
    bf16_window = dataclasses.replace(kv_handle.layout, dtype="bfloat16")
    assert 2 * kv_handle.layout.nbytes == bf16_window.nbytes
    assert states_handle.layout.dtype == "float32", "encoder states stay in the model's dtype"

    receiver = make_receiver(transfer_config(connector), storage=engine.runner.storage)
    for handle in (kv_handle, states_handle):
        source = TransferredCrossKV(handle, receiver)
        engine.submit(engine.make_request(DecodeOptions(), source, request_id=handle.request_id))
    results = run_to_completion_by_id(engine)
    assert results[kv_handle.request_id].tokens == expected
    assert results[states_handle.request_id].tokens == expected
    assert engine.pool.num_used_blocks == 0
    assert wait_until(lambda: Stager(encoder_side, f"{connector}-{BLOCK}").num_staged() == 0)
    receiver.close()


# --- config ----------------------------------------------------------------------------------


def test_config_rejects_unknown_fields_and_bad_values_by_name():
    with pytest.raises(ValidationError, match="staging_memory_gb"):
        TransferConfig(staging_memory_gb=1)
    with pytest.raises(ValidationError, match="staging_memory_mb"):
        TransferConfig(staging_memory_mb=0)
    with pytest.raises(ValidationError, match="connector"):
        TransferConfig(connector="rdma")
    with pytest.raises(ValidationError, match="staged_poll_interval_ms"):
        TransferConfig(staged_poll_interval_ms=0)
    with pytest.raises(ValidationError, match="sender_progress_thread"):
        TransferConfig(sender_progress_thread="always")


def test_auto_picks_nixl_here_and_ships_kv_over_it_but_states_through_the_object_store():
    assert TransferConfig().resolved_connector() == "nixl"
    assert TransferConfig().resolved_mode() == "cross_kv"
    assert TransferConfig(connector="local").resolved_mode() == "cross_kv"
    assert TransferConfig(connector="object_store").resolved_mode() == "encoder_states"
    assert TransferConfig(connector="object_store", mode="cross_kv").resolved_mode() == "cross_kv"
