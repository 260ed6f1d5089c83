"""A decoder replica's engine in a process of its own, called from the replica's event loop.

Why: a replica's process answers Serve's calls (Python under the GIL each, measured by
benchmarks/bench_serve_call.py) and its decode loop is a thread beside them, so every call the
replica answers is host time the loop's steps wait for. In a child process the loop shares its
interpreter only with the cheap message handling below (vLLM runs its engine core apart from its
API server for the same reason).

The child builds the object (``factory(*args)``) and hands it each call's message (a data class,
deployments/decoder_api.py for the decoder's) through its ``answer`` method, on an asyncio loop of
its own, so the object's coroutines (a window waiting for its encoder batch and its decode) run
there as they would in the replica. Messages over one pipe:

    parent -> child   (call_id, message)               a call (answered sync or async)
                      (call_id, CANCEL)                the caller went away: cancel that call
    child -> parent   (call_id, ok, value or error)    its outcome

The child exits when the pipe closes: the replica was stopped or killed, and nothing may outlive
it holding the GPU. The parent fails every call in flight when the child exits, so no request
waits for an answer that cannot come, and ``alive`` turns false for the replica's health check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import multiprocessing
import os
import pickle
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from engine.errors import RetriableError

logger = logging.getLogger("ray.serve")

READY = -1  # the call id of the child's first message: the object is built (or why not)


class Cancel:
    """The caller of a call went away: cancel it in the child."""


CANCEL = Cancel()


class Answerer(Protocol):
    """What the child runs: it answers each call's message, with a value or an awaitable of one."""

    def answer(self, message: Any) -> Any | Awaitable[Any]: ...


class EngineProcessExited(RetriableError):
    """The engine's process is gone; the replica cannot serve until Serve replaces it (its health
    check fails), so the window is worth trying again."""


class EngineProcess:
    def __init__(self, factory: Callable[..., Answerer], *args: Any, start_timeout_s: float = 1800.0):
        """Starts the child and waits until ``factory(*args)`` is built there; raises
        EngineProcessExited with the child's reason if it could not be."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_conn, factory, args), name="engine", daemon=True
        )
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its exit closes the pipe here
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise EngineProcessExited(f"the engine process was not ready within {start_timeout_s:.0f} s")
        try:
            _, ok, value = self._conn.recv()
        except EOFError:
            ok, value = False, "it exited while starting; see the replica's log"
        if not ok:
            self._process.join(timeout=5)
            raise EngineProcessExited(f"the engine process could not start: {value}")
        self.ready_info = value
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._pending_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._exited = False
        self._closing = False
        self._reader = threading.Thread(target=self._read_answers, name="engine-answers", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._exited and self._process.is_alive()

    async def call(self, message: Any) -> Any:
        """The child's answer to ``message``; cancelling this cancels the call in the child."""
        call_id, future = self._send_call(message)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._send((call_id, CANCEL))
            raise

    def call_blocking(self, message: Any, timeout_s: float = 30.0) -> Any:
        """The same from a thread that is no event loop."""
        _, future = self._send_call(message)
        return future.result(timeout=timeout_s)

    def close(self) -> None:
        """Ends the child: its pipe closes and it exits; killed if it does not within 10 s."""
        self._closing = True
        # Shut the socket down before closing it: the answer reader's recv holds the socket open
        # until it returns, so a close alone would leave both it and the child waiting for an end
        # that never comes, and the child would be killed here instead of exiting.
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()

    def _send_call(self, message: Any) -> tuple[int, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            if self._exited:
                raise EngineProcessExited("the engine process has exited")
            call_id = next(self._call_ids)
            self._pending[call_id] = future
        self._send((call_id, message))
        return call_id, future

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as error:
            self._fail_pending(
                EngineProcessExited(f"the engine process has exited ({error.strerror or error})")
            )

    def _read_answers(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._pending_lock:
                future = self._pending.pop(call_id, None)
            if future is None or future.done():
                continue  # cancelled by its caller
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        if not self._closing:
            code = self._process.exitcode if not self._process.is_alive() else None
            logger.error("the engine process exited (exit code %s); failing the calls in flight", code)
        self._fail_pending(EngineProcessExited("the engine process exited; the replica is being replaced"))

    def _fail_pending(self, error: Exception) -> None:
        with self._pending_lock:
            self._exited = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)


def _child_main(conn, factory: Callable[..., Answerer], args: tuple) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine process: %(message)s")
    try:
        target = factory(*args)
    except BaseException as error:  # noqa: BLE001 - every reason reaches the replica, in words
        logger.exception("the engine could not be built")
        conn.send((READY, False, f"{type(error).__name__}: {error}"))
        return
    conn.send((READY, True, getattr(target, "ready_info", None)))
    asyncio.run(_answer_calls(conn, target))


async def _answer_calls(conn, target: Answerer) -> None:
    loop = asyncio.get_running_loop()
    running: dict[int, asyncio.Task] = {}

    async def answer(call_id: int, message: Any) -> None:
        try:
            value = target.answer(message)
            if inspect.isawaitable(value):
                value = await value
            outcome = (call_id, True, value)
        except asyncio.CancelledError:
            return  # the caller went away; nothing waits for an answer
        except Exception as error:  # noqa: BLE001 - the caller gets it, as a call in process would
            outcome = (call_id, False, _sendable(error))
        finally:
            running.pop(call_id, None)
        conn.send(outcome)

    def read_calls() -> None:
        while conn.poll():
            try:
                call_id, message = conn.recv()
            except (EOFError, OSError):
                # The replica is gone: nothing may outlive it holding the GPU, and no one waits.
                os._exit(0)
            if isinstance(message, Cancel):
                task = running.get(call_id)
                if task is not None:
                    task.cancel()
            else:
                running[call_id] = loop.create_task(answer(call_id, message))

    loop.add_reader(conn.fileno(), read_calls)
    await asyncio.Event().wait()  # served until the pipe closes


def _sendable(error: Exception) -> Exception:
    """``error`` if it survives pickling (the replica raises the same type), else its words."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
