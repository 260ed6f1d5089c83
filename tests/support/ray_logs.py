"""What a test's Ray session wrote to its logs since a moment the test marks: Serve's file per
replica (and proxy and controller) under serve/, and each worker process's stdout and stderr,
where a replica's own log lines land too."""

from __future__ import annotations

from pathlib import Path


def session_logs() -> Path:
    """The logs of the Ray session on this machine (the one the test's app runs in)."""
    return Path("/tmp/ray/session_latest/logs").resolve()


def log_files(logs: Path) -> list[Path]:
    return [*logs.glob("serve/*.log"), *logs.glob("worker-*.err"), *logs.glob("worker-*.out")]


def log_sizes(logs: Path) -> dict[Path, int]:
    """Each log file's size now: the mark ``written_since`` reads from."""
    return {path: path.stat().st_size for path in log_files(logs)}


def written_since(sizes: dict[Path, int], logs: Path) -> dict[str, str]:
    """What each log file gained since ``sizes`` was taken (a file new since: all of it), by name."""
    written = {}
    for path in log_files(logs):
        with open(path, "rb") as log:
            log.seek(sizes.get(path, 0))
            written[path.name] = log.read().decode(errors="replace")
    return written
