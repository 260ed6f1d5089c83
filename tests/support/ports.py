"""A free local port for a server that a test or a benchmark starts beside a Ray it starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's workers take ports from 10002 to 19999 unless told otherwise (ray.init's min/max_worker_port).
_ABOVE_RAY_WORKER_PORTS = 20000


def _ephemeral_ports_start() -> int:
    """Where the ports the system hands out for port 0 begin (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, chosen below the range the system hands
    out for port 0 and above Ray's worker ports. A port that a probe got for port 0 could be handed
    out again to a server Ray starts next (its GCS, raylet and agents bind port 0), before the
    test's own server binds it."""
    high = _ephemeral_ports_start() - 1
    if high <= _ABOVE_RAY_WORKER_PORTS:
        raise RuntimeError(f"the system hands out ports from {high + 1} for port 0: no room above Ray's")
    for _ in range(200):
        port = random.randint(_ABOVE_RAY_WORKER_PORTS, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {_ABOVE_RAY_WORKER_PORTS} and {high}")
