"""A clock the tests move by hand, for the scheduler's policy (it reads time through an injected clock)."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
