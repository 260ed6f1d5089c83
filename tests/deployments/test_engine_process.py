"""deployments/engine_process.py: a decoder replica's engine in a child process. Calls reach the
child and their outcomes come back (errors as their own type), a caller that goes away cancels its
call in the child, a child that dies fails every call in flight at once, and the child never
outlives its replica's process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import psutil
import pytest

from deployments.engine_process import EngineProcess, EngineProcessExited


@dataclass(frozen=True)
class Add:
    a: int
    b: int


@dataclass(frozen=True)
class Refuse:
    why: str


@dataclass(frozen=True)
class Pid:
    pass


@dataclass(frozen=True)
class WaitForever:
    pass


@dataclass(frozen=True)
class CancelledCalls:
    pass


class Probe:
    """What the child runs in these tests: it answers the messages above."""

    def __init__(self, fail_to_start: bool = False):
        if fail_to_start:
            raise ValueError("no such model folder")
        self.ready_info = f"probe in {os.getpid()}"
        self.cancelled = 0

    def pid(self) -> int:
        return os.getpid()

    async def add(self, a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    def refuse(self, why: str) -> None:
        raise ValueError(why)

    async def wait_forever(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def cancelled_calls(self) -> int:
        return self.cancelled

    def answer(self, message):
        match message:
            case Add(a, b):
                return self.add(a, b)
            case Refuse(why):
                return self.refuse(why)
            case Pid():
                return self.pid()
            case WaitForever():
                return self.wait_forever()
            case CancelledCalls():
                return self.cancelled_calls()
        raise TypeError(f"not a probe call: {message!r}")


@pytest.fixture(scope="module")
def probe():
    engine = EngineProcess(Probe)
    yield engine
    engine.close()


def test_calls_reach_the_child_and_errors_come_back_as_their_own_type(probe):
    async def calls():
        assert await probe.call(Add(2, 3)) == 5
        with pytest.raises(ValueError, match="that option"):
            await probe.call(Refuse("that option"))
        return await probe.call(Pid())

    child_pid = asyncio.run(calls())
    assert child_pid != os.getpid() and probe.ready_info == f"probe in {child_pid}"
    assert probe.call_blocking(Add(4, 5)) == 9  # coroutines too, from a thread that is no event loop


def test_a_caller_that_goes_away_cancels_its_call_in_the_child(probe):
    async def go_away():
        before = await probe.call(CancelledCalls())
        waiting = asyncio.ensure_future(probe.call(WaitForever()))
        await asyncio.sleep(0.3)
        waiting.cancel()
        deadline = time.monotonic() + 10
        while await probe.call(CancelledCalls()) == before:
            assert time.monotonic() < deadline, "the child's call was never cancelled"
            await asyncio.sleep(0.05)

    asyncio.run(go_away())


def test_a_child_that_dies_fails_every_call_in_flight_and_the_next_ones():
    engine = EngineProcess(Probe)

    async def die_mid_call():
        waiting = [asyncio.ensure_future(engine.call(WaitForever())) for _ in range(3)]
        await asyncio.sleep(0.3)
        os.kill(await engine.call(Pid()), signal.SIGKILL)
        for call in waiting:
            with pytest.raises(EngineProcessExited):
                await asyncio.wait_for(call, timeout=10)

    asyncio.run(die_mid_call())
    assert not engine.alive
    with pytest.raises(EngineProcessExited):
        engine.call_blocking(Pid())
    engine.close()


def test_a_child_that_cannot_start_says_why_in_words():
    with pytest.raises(EngineProcessExited, match="ValueError: no such model folder"):
        EngineProcess(Probe, True)


@pytest.mark.slow
def test_the_child_does_not_outlive_a_killed_replica_process():
    """A replica killed outright (SIGKILL: no clean-up of its own runs) must not leave its engine
    holding the GPU: the child sees its pipe close and exits."""
    replica = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import time
                from deployments.engine_process import EngineProcess
                from tests.deployments.test_engine_process import Pid, Probe
                engine = EngineProcess(Probe)
                print(engine.call_blocking(Pid()), flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        child = psutil.Process(int(replica.stdout.readline()))
        assert child.is_running()
        replica.send_signal(signal.SIGKILL)
        replica.wait(timeout=10)
        deadline = time.monotonic() + 15
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the engine process outlived its replica"
            time.sleep(0.1)
    finally:
        replica.kill()
