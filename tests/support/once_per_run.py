"""Results several test modules need, computed once per test run and shared by pytest-xdist's
workers: the first worker to ask computes and saves them, under a lock, and the others load them
(pytest's documented pattern for session data under xdist)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from filelock import FileLock  # a dependency of torch's

T = TypeVar("T")


def computed_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, inputs: object, compute: Callable[[], T]
) -> T:
    """``compute()``, or what a worker of this run saved under ``name`` for the same ``inputs``
    (everything the result depends on, as JSON: the model's config, the clips, the options).
    Saved with torch.save, so tensors and plain containers of them round-trip."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = _run_folder(tmp_path_factory) / f"{name}-{digest}.pt"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return torch.load(path, weights_only=False)
        result = compute()
        torch.save(result, path)
        return result


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Under xdist each worker's base folder sits in one folder of the run's own; without it,
    the base folder is the run's (its parent holds earlier runs' folders)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
