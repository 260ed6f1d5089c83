"""The real app on a local Ray, for the tests that talk to it over HTTP: one place that starts Ray
and Serve, runs the app and shuts both down."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import yaml

from tests.support.network import free_port
from tests.support.paths import CONFIGS_DIR


def default_app_args() -> dict[str, Any]:
    """The args of `make serve`'s app (configs/default.yaml), for a test to override."""
    return yaml.safe_load((CONFIGS_DIR / "default.yaml").read_text())["applications"][0]["args"]


@contextlib.contextmanager
def running_app(args: dict[str, Any]) -> Iterator[str]:
    """Start a local Ray (as `serve run` does: it sees this machine's cores), run the app built from
    ``args`` at ``/`` and yield its base URL; shut Serve and Ray down after."""
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="whisper", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_actor(deployment: str):
    """The one replica actor of ``deployment`` (e.g. "WhisperDecoder") in the running app, for a
    fault test to kill (Serve replaces it)."""
    import ray

    names = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")
