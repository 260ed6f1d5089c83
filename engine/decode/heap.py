"""The decode loop's Python heap: what a process made while starting kept out of the garbage
collector's full collections.

A serving process holds a large, long-lived heap (the model's modules and parameters, the
tokenizer, captured graphs, Ray's and the web framework's objects). CPython's collector walks
every tracked object when a full collection runs, and a decode loop that allocates many small
objects each step (a beam search's choices, followed every step) triggers collections: each full
one is a pause of milliseconds that the loop pays between two steps, with the device idle.
Frozen (``gc.freeze``, as vLLM does after start-up), those objects are left out of every
collection, so a collection walks only what the loop made since.

Frozen objects stay alive until ``gc.unfreeze``, even if they later become unreachable garbage
in a cycle, so this is for a process that keeps what it started with for its life (a decoder
replica), not for one that builds and drops many engines.
"""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> int:
    """Collect what is garbage now, then freeze every object still alive; returns how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
