"""The run's one local Ray for the apps of tests/support/serving.py's running_app.

The modules that start Ray run one after another on one pytest worker (tests/conftest.py), and each
app stops with its module: the next module's app starts on the same Ray (and the same Serve) rather
than wait for a Ray of its own to start and stop. tests/conftest.py stops it when the worker moves
on to a module without Ray; a module that needs a Ray of another shape stops it first (own_ray)."""

from __future__ import annotations

import sys
from collections.abc import Callable

# What runs on the run's local Ray and must stop before it (serving.py's Serve and a shared app).
_before_stopping: list[Callable[[], None]] = []


def local_ray() -> None:
    """Connect to the run's local Ray, starting it (as `serve run` does: it sees this machine's
    cores) if none is up."""
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)


def before_stopping(stop: Callable[[], None]) -> None:
    """Have ``stop`` called whenever own_ray stops the run's local Ray (first, while Ray is up)."""
    if stop not in _before_stopping:
        _before_stopping.append(stop)


def own_ray() -> None:
    """Stop the run's local Ray if one is up: for a module that starts a Ray of its own (a cluster
    of several raylets, other resources, or environment variables its processes must inherit), and
    after the last module with Ray. Ray not imported yet: none is up."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        for stop in _before_stopping:
            stop()
        ray.shutdown()
