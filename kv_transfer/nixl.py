"""NIXL connector: the decoder READs staged blocks straight from the encoder's staging memory into
its own paged cache, one descriptor per block (UCX picks the path: CUDA IPC or NVLink between GPUs,
RDMA across hosts, shared memory / CMA between processes on host memory).

- Agents: one per sender and one per receiver, created once (kv_transfer/nixl_agent.py). On a GPU
  the CUDA context must be live before the agent starts, or UCX settles on host transports
  (shared/gpu/README.md). A READ of a sender's GPU memory completes only while the sender's agent
  makes progress, so a sender staging there runs NIXL's progress thread
  (transfer.sender_progress_thread): progress made from Python waits for the GIL, which the
  encoder replica's own threads hold.
- Registration: the sender's staging tensor and the receiver's KV cache tensor are registered
  once; every transfer is a list of (address, length) descriptors inside them.
- Metadata: the sender's agent metadata (~0.5 KB) rides in every handle; a receiver loads it the
  first time it meets that sender and reuses the connection afterwards.
- Release: the receiver READs the payload, then the entry's header (its token) with a
  notification that carries the token; the sender's service thread polls notifications and frees
  the entry. A header that no longer holds the token means the entry was released or reused
  before the pull: the pull fails instead of handing out another request's bytes.
- Pulls side by side: the agent is not thread-safe, so every call into it holds one lock, but
  only for the call; a pull waits for its READ outside it, sleeping between polls. Each pull has
  a header slot of its own. A decoder's loader pulls several windows at once, and a slow one holds
  back only itself; a poll that spun instead would hold Python's GIL against the decode loop.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.block_pool import block_runs
from engine.kv.storage import PagedKVStorage
from kv_transfer.base import IncompatibleHandleError, KVReceiver, TransferError, TransferHandle
from kv_transfer.config import TransferConfig
from kv_transfer.nixl_agent import make_agent, memory_kind
from kv_transfer.staging import STAGING_ALIGNMENT, StagedEntry, StagingBuffer, StagingSender, synchronize

logger = logging.getLogger(__name__)

_RELEASE_PREFIX = b"kv-release:"
# A READ is polled after sleeps doubling from the first to the last: a window lands between GPUs in
# well under a millisecond, and on a slow link a poll a millisecond is enough.
_FIRST_POLL_S, _LAST_POLL_S = 20e-6, 1e-3
_HEADER_SLOTS = 16  # pulls in flight at once through one receiver; more wait for a slot


def _descriptors(addresses, lengths, device_id: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array: (address, length, device id) per region."""
    addresses = np.asarray(addresses, dtype=np.uint64)
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), addresses.shape)
    return np.stack([addresses, lengths, np.full_like(addresses, device_id)], axis=1)


def _block_runs(block_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive cache block ids: (first staged block, first cache block, length) each.
    A pool hands out mostly consecutive ids, and posting a READ costs CPU per descriptor."""
    runs = block_runs(block_ids)
    lengths = np.array([count for _, count in runs], dtype=np.int64)
    staged_starts = np.cumsum(lengths) - lengths
    return staged_starts, np.array([first for first, _ in runs], dtype=np.int64), lengths


@dataclass(frozen=True)
class NixlLocation:
    """Where a staged entry sits in the sender's registered staging memory."""

    agent_metadata: bytes  # the sender agent's metadata: connection info and registered regions
    payload_address: int
    header_address: int
    memory_type: str  # "DRAM" | "VRAM"
    device_id: int


class NixlSender(StagingSender):
    connector = "nixl"
    header_bytes = StagingBuffer.header_bytes

    def __init__(self, config: TransferConfig, block_size: int, device: torch.device):
        super().__init__(config, block_size, sender_id=f"kv-sender-{uuid.uuid4().hex[:12]}")
        device = torch.device(device)
        self.agent = make_agent(self.sender_id, device, config.sender_progress_thread_on(device))
        self.buffer = StagingBuffer(self.arena.capacity_bytes, device)
        self._registration = self.agent.register_memory(self.buffer.tensor)
        self._memory_type, self._device_id = memory_kind(self.buffer.tensor)
        self._metadata = self.agent.get_agent_metadata()
        self._start_service()
        # A thread still inside the agent when the interpreter tears it down aborts the process.
        atexit.register(self.close)

    def _write(self, entry: StagedEntry, staged: torch.Tensor) -> NixlLocation:
        self.buffer.write(entry, staged)
        return NixlLocation(
            agent_metadata=self._metadata,
            payload_address=self.buffer.payload_address(entry),
            header_address=self.buffer.header_address(entry),
            memory_type=self._memory_type,
            device_id=self._device_id,
        )

    def _discard(self, entry: StagedEntry, pulled: bool) -> None:
        self.buffer.clear(entry)  # a second pull of the same handle, or a late one, now fails

    def _wait_pulled(self, timeout_s: float) -> list[int]:
        tokens = []
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                if message.startswith(_RELEASE_PREFIX):
                    tokens.append(int(message[len(_RELEASE_PREFIX) :]))
        if not tokens:
            # A READ of staged GPU memory completes only while this agent makes progress: while
            # windows wait to be pulled, poll often. (Host memory is read without the sender.)
            staged = self._memory_type == "VRAM" and self.num_staged > 0
            self._closed.wait(self.config.staged_poll_interval_ms / 1000 if staged else timeout_s)
        return tokens

    def close(self) -> None:
        if self._closed.is_set():
            return
        atexit.unregister(self.close)
        super().close()
        self.agent.deregister_memory(self._registration)


class NixlReceiver(KVReceiver):
    connector = "nixl"

    def __init__(
        self,
        config: TransferConfig,
        storage: PagedKVStorage | None = None,
        device: torch.device | None = None,
    ):
        self.config = config
        self.device = storage.cache.device if storage is not None else torch.device(device or "cpu")
        self.name = f"kv-receiver-{uuid.uuid4().hex[:12]}"
        self.agent = make_agent(self.name, self.device)
        self._agent_lock = threading.Lock()  # held for each call into the agent, never for a wait
        self._registrations: dict[int, tuple[torch.Tensor, object]] = {}  # data_ptr -> (tensor, registration)
        self._remote_agents: set[str] = set()
        # Where each pull's header lands: a slot per pull in flight.
        self._headers = torch.zeros(
            _HEADER_SLOTS, STAGING_ALIGNMENT // 8, dtype=torch.int64, device=self.device
        )
        self._register(self._headers)
        self._free_headers: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(_HEADER_SLOTS):
            self._free_headers.put(slot)
        self._states_lock = threading.Lock()  # one encoder_states pull at a time: they share a buffer
        self._states: torch.Tensor | None = None  # receive buffer for encoder_states, grown on demand
        if storage is not None:
            self._register(storage.cache)
        self._closed = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, name=f"{self.name}-progress", daemon=True
        )
        self._progress.start()
        atexit.register(self.close)  # as for the sender: no thread inside the agent at teardown

    def pull_blocks(self, handle: TransferHandle, storage: PagedKVStorage, block_ids: list[int]) -> None:
        self.check_connector(handle)
        layout = handle.layout
        try:
            layout.check_fits(storage, block_ids)
        except IncompatibleHandleError:
            self.discard(handle)
            raise
        cache = storage.cache
        with self._agent_lock:
            self._register(cache)
        memory_type, device_id = memory_kind(cache)
        # Block-major on both sides: staged block i and cache block block_ids[i] are each one
        # contiguous region, and so is a run of them.
        block_bytes = np.uint64(layout.bytes_per_block)
        staged_starts, cache_starts, run_lengths = (run.astype(np.uint64) for run in _block_runs(block_ids))
        local = _descriptors(
            np.uint64(cache.data_ptr()) + cache_starts * block_bytes, run_lengths * block_bytes, device_id
        )
        remote = _descriptors(
            np.uint64(handle.location.payload_address) + staged_starts * block_bytes,
            run_lengths * block_bytes,
            handle.location.device_id,
        )
        self._read_checked(handle, local, memory_type, remote)

    def pull_states(self, handle: TransferHandle) -> torch.Tensor:
        self.check_connector(handle)
        layout = handle.layout
        with self._states_lock:
            with self._agent_lock:
                buffer = self._states_buffer(layout.nbytes)
            memory_type, device_id = memory_kind(buffer)
            local = _descriptors([buffer.data_ptr()], layout.nbytes, device_id)
            remote = _descriptors([handle.location.payload_address], layout.nbytes, handle.location.device_id)
            self._read_checked(handle, local, memory_type, remote)
            # A copy, finished before the lock is let go: the next pull overwrites the buffer.
            states = buffer[: layout.nbytes].view(layout.torch_dtype).view(layout.shape).clone()
            synchronize(self.device)
            return states

    def close(self) -> None:
        if self._closed.is_set():
            return
        atexit.unregister(self.close)
        self._closed.set()
        self._progress.join()
        with self._agent_lock:
            for remote_agent in list(self._remote_agents):
                self._forget(remote_agent)
            for _tensor, registration in self._registrations.values():
                self.agent.deregister_memory(registration)
            self._registrations.clear()

    def _progress_loop(self) -> None:
        """Without NIXL's progress thread, a release notification queued by the last READ (or the
        connection it travels on) only moves while this agent is called: keep calling it."""
        interval_s = self.config.release_poll_interval_ms / 1000
        while not self._closed.wait(interval_s):
            if self._agent_lock.acquire(blocking=False):  # busy: a pull's own calls drive progress
                try:
                    self.agent.get_new_notifs()
                except Exception:
                    logger.debug("NIXL progress poll failed", exc_info=True)
                finally:
                    self._agent_lock.release()

    # --- one pull ------------------------------------------------------------------------------

    @contextmanager
    def _header_slot(self) -> Iterator[torch.Tensor]:
        """A zeroed header slot of this pull's own (waits while every slot is in flight)."""
        slot = self._free_headers.get()
        try:
            header = self._headers[slot]
            header.zero_()
            synchronize(self.device)  # or the zeroing could land after the READ
            yield header
        finally:
            self._free_headers.put(slot)

    def _read_checked(
        self, handle: TransferHandle, local: np.ndarray, memory_type: str, remote: np.ndarray
    ) -> None:
        """READ the payload, then the entry's header with the release notification; fail unless the
        header still holds this handle's token. Any failure releases the sender's staging."""
        location: NixlLocation = handle.location
        deadline = time.monotonic() + self.config.pull_timeout_s
        remote_agent = handle.sender_id
        with self._header_slot() as header:
            try:
                with self._agent_lock:
                    self._connect(remote_agent, location.agent_metadata)
                self._read(handle, local, memory_type, remote, b"", deadline)
                header_type, header_device = memory_kind(header)
                header_local = _descriptors([header.data_ptr()], 8, header_device)
                header_remote = _descriptors([location.header_address], 8, location.device_id)
                release = _RELEASE_PREFIX + str(handle.staging_token).encode()
                self._read(handle, header_local, header_type, header_remote, release, deadline)
            except TransferError:
                self.discard(handle)
                raise
            except Exception as error:  # NIXL raises its own types (e.g. nixlRemoteDisconnectError)
                with self._agent_lock:
                    self._release_unpulled(handle)
                    self._forget(remote_agent)
                raise TransferError(
                    f"pulling {handle.request_id} from {remote_agent} failed: {error!r}"
                ) from error
            token = int(header[0])
        if token != handle.staging_token:
            raise TransferError(
                f"staging for {handle.request_id} was released before the pull "
                "(unclaimed_timeout_s or released)"
            )

    def _read(
        self,
        handle: TransferHandle,
        local: np.ndarray,
        local_type: str,
        remote: np.ndarray,
        notification: bytes,
        deadline: float,
    ) -> None:
        remote_agent, remote_type = handle.sender_id, handle.location.memory_type
        with self._agent_lock:
            transfer = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, local_type),
                self.agent.get_xfer_descs(remote, remote_type),
                remote_agent,
                notification,
            )
        state = "PROC"
        try:
            with self._agent_lock:
                state = self.agent.transfer(transfer)
            pause_s = _FIRST_POLL_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"pulling {handle.request_id} from {remote_agent} "
                        f"took over {self.config.pull_timeout_s} s"
                    )
                time.sleep(pause_s)  # lets the GIL go: the decode loop runs while this waits
                pause_s = min(pause_s * 2, _LAST_POLL_S)
                with self._agent_lock:
                    state = self.agent.check_xfer_state(transfer)
            if state != "DONE":
                raise TransferError(f"NIXL READ of {handle.request_id} from {remote_agent} failed")
        finally:
            with self._agent_lock:
                self._release_transfer(transfer, remote_agent, in_flight=state == "PROC")

    def _release_transfer(self, transfer, remote_agent: str, in_flight: bool) -> None:
        try:
            transfer.release()  # cancels a READ still in flight
        except Exception:
            if not in_flight:
                raise
            # A READ that cannot be cancelled could still land in blocks the engine is about to
            # free and hand to another request: disconnecting the agent aborts it.
            logger.exception("could not cancel a timed-out READ from %s; disconnecting it", remote_agent)
            self._forget(remote_agent)
            transfer.release()

    def discard(self, handle: TransferHandle) -> None:
        with self._agent_lock:
            self._release_unpulled(handle)

    # --- with the agent lock held ----------------------------------------------------------------

    def _connect(self, remote_agent: str, metadata: bytes) -> None:
        if remote_agent not in self._remote_agents:
            loaded = self.agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != remote_agent:
                raise TransferError(f"handle names sender {remote_agent}, its metadata is {loaded}'s")
            self._remote_agents.add(remote_agent)

    def _forget(self, remote_agent: str) -> None:
        if remote_agent in self._remote_agents:
            self._remote_agents.discard(remote_agent)
            try:
                self.agent.remove_remote_agent(remote_agent)
            except Exception:
                logger.debug("removing NIXL agent %s failed", remote_agent, exc_info=True)

    def _release_unpulled(self, handle: TransferHandle) -> None:
        """Best effort: tell a sender that is still there to free staging we will not pull."""
        try:
            self._connect(handle.sender_id, handle.location.agent_metadata)
            self.agent.send_notif(handle.sender_id, _RELEASE_PREFIX + str(handle.staging_token).encode())
        except Exception:
            self._forget(handle.sender_id)  # gone: its staging went with it

    def _register(self, tensor: torch.Tensor) -> None:
        if tensor.data_ptr() not in self._registrations:
            self._registrations[tensor.data_ptr()] = (tensor, self.agent.register_memory(tensor))

    def _states_buffer(self, nbytes: int) -> torch.Tensor:
        if self._states is None or self._states.numel() < nbytes:
            if self._states is not None:
                _tensor, registration = self._registrations.pop(self._states.data_ptr())
                self.agent.deregister_memory(registration)
            self._states = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._register(self._states)
        return self._states
