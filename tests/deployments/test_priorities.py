"""Interactive and batch requests on one server: behind a backlog of long batch files, short
interactive requests overtake the backlog's windows at the encoder and the decoder.

One encoder and one decoder replica on a local Ray. The knobs: of the decoder's two sequence
slots one is kept for interactive work (engine.interactive_reserved_seqs; on CPU a decoder step's
time grows with every sequence in it, so batch work gets one), encoder batches of one window (an
interactive window waits at most for the forward already running), one torch thread per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.serving import running_app
from tests.support.speech import dense_speech_file, short_english_clips

pytestmark = pytest.mark.ray

INTERACTIVE_REQUESTS = 12
BATCH_CLIENTS = 4


@pytest.fixture(scope="module")
def server_url():
    args = {
        "engine": {
            "model": "tiny.en",
            "max_num_seqs": 2,
            "interactive_reserved_seqs": 1,
            "kv_cache_memory_mb": 300,
        },
        "transfer": {"connector": "object_store"},
        "encoder": {"num_cpus": 0.5, "torch_threads": 1, "max_batch_size": 1},
        "decoder": {"num_cpus": 0.5, "torch_threads": 1},
        "ingress": {"num_cpus": 0.25, "max_ongoing_requests": 1024},
    }
    with running_app(args) as url:
        yield url


def _post(http: httpx.Client, url: str, data: bytes, priority: str | None = None) -> httpx.Response:
    fields = {"model": "tiny.en", **({"priority": priority} if priority else {})}
    return http.post(f"{url}/v1/audio/transcriptions", files={"file": ("audio.wav", data)}, data=fields)


def _interactive_latencies_s(url: str, count: int = INTERACTIVE_REQUESTS) -> list[float]:
    clips = [clip.path.read_bytes() for clip in short_english_clips()[:count]]
    latencies = []
    with httpx.Client(timeout=300) as http:
        for data in clips:  # one at a time, as a person waits for each
            started = time.perf_counter()
            response = _post(http, url, data)  # no field: short audio defaults to interactive
            assert response.status_code == 200, response.text
            latencies.append(time.perf_counter() - started)
    return latencies


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_an_unknown_priority_is_rejected_with_its_field_named(server_url):
    with httpx.Client(timeout=60) as http:
        response = _post(http, server_url, short_english_clips()[0].path.read_bytes(), priority="urgent")
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


@contextlib.contextmanager
def _background_load(url: str, data: bytes, priority: str, num_clients: int) -> Iterator[list[int]]:
    """Clients sending ``data`` in a loop while the block runs; yields the status codes of the files
    answered so far. At the end, once a file has been answered, they hang up on the files still in
    flight rather than wait for them: the server drops a request whose client went away, so the
    next phase starts without this backlog, and no test waits for long files nobody reads."""
    statuses: list[int] = []
    loop = asyncio.new_event_loop()

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            response = await http.post(
                f"{url}/v1/audio/transcriptions",
                files={"file": ("audio.wav", data)},
                data={"model": "tiny.en", "priority": priority},
            )
            statuses.append(response.status_code)

    async def clients() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(client(http) for _ in range(num_clients)))

    load = loop.create_task(clients())

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(load)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield statuses
    finally:
        while not statuses and not load.done():
            time.sleep(0.1)
        loop.call_soon_threadsafe(load.cancel)
        thread.join()
        loop.close()


def _latencies_behind_a_backlog_s(
    url: str, backlog_priority: str, count: int
) -> tuple[list[float], list[int]]:
    with _background_load(url, dense_speech_file(), backlog_priority, BATCH_CLIENTS) as backlog_statuses:
        time.sleep(5)  # the backlog builds: its windows queue at the encoder and the decoder
        return _interactive_latencies_s(url, count), backlog_statuses


def test_interactive_requests_overtake_a_backlog_of_long_files_sent_as_batch(server_url):
    """The same backlog of long files, sent once as batch work and once as interactive (first come,
    first served): as batch it yields the encoder and the reserved decoder slot to the short
    interactive requests, which are then served much faster. (It still shares decoder steps with
    them: on a CPU a step's time grows with every sequence in it, so they are slower than on the idle
    server.)"""
    _interactive_latencies_s(server_url, count=2)  # warm-up: first requests pay one-off costs
    behind_batch, batch_statuses = _latencies_behind_a_backlog_s(server_url, "batch", INTERACTIVE_REQUESTS)
    # Fewer samples: each waits for the backlog's windows queued before it, all of them far longer
    # than any request behind the batch backlog.
    behind_fifo, fifo_statuses = _latencies_behind_a_backlog_s(server_url, "interactive", 2)
    print(
        f"interactive p99: behind a batch backlog {_p99(behind_batch):.2f} s, "
        f"behind the same backlog first come first served {_p99(behind_fifo):.2f} s; "
        f"{len(batch_statuses)} batch files done meanwhile"
    )
    assert batch_statuses and set(batch_statuses) == {200}, "the batch work is served too, not starved"
    assert set(fifo_statuses) == {200}
    assert _p99(behind_batch) <= 0.75 * _p99(behind_fifo), (
        f"behind batch {sorted(behind_batch)}, behind first come first served {sorted(behind_fifo)}"
    )
