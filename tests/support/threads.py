"""How many CPU threads a reference system (faster-whisper, senko) runs on beside our engine."""

from __future__ import annotations

import torch


def reference_threads() -> int:
    """As many as the test worker gives torch: one under `make test` (tests/conftest.py), where the
    other worker keeps the second core busy. An OpenMP runtime (CTranslate2's, torch's) with more
    threads than it has cores spins at each barrier while a peer waits for a core, and spends
    several times the CPU time of one thread for the same result."""
    return torch.get_num_threads()
