"""engine/decode/heap.py: what a process made while starting is left out of later collections,
and what is garbage at that moment is collected first rather than frozen."""

from __future__ import annotations

import gc
import weakref

from engine.decode.heap import freeze_start_up_objects


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_start_up_objects_are_frozen_and_garbage_is_collected_first():
    kept = [_Node()]
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_start_up_objects()
        assert gone() is None, "garbage in a cycle was frozen instead of collected"
        # (Not equal to the count now: other threads' frozen objects may have been freed since.)
        assert frozen > 0 and gc.get_freeze_count() > 0
        # A full collection no longer walks what was alive at start-up.
        assert not any(tracked is kept for tracked in gc.get_objects())
        made_later = [_Node()]
        assert any(tracked is made_later for tracked in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(tracked is kept for tracked in gc.get_objects())
