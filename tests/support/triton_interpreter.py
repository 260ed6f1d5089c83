"""Triton's CPU interpreter, which runs the engine's kernels in tests, without its repeated set-up.

The interpreter swaps triton.language's functions for interpreted ones around each kernel launch,
and again on every call of a JIT helper inside a kernel (tl.max, tl.sum, ... are such helpers):
each swap walks the language's modules with ``inspect.getmembers``. A kernel that reduces in a
loop, once per program of its grid, spent most of its interpreted time there. Within a launch a
swap changes nothing after the first of the same modules (functions already swapped are left as
they are, and nothing is restored before the launch ends), so here a launch swaps the modules a
function sees at its first call only. Every operation of a kernel is still interpreted as it was.

Each interpreted operation also looks up the numpy dtype of its Triton dtype, and the lookup builds
its table of every dtype anew on each call: here a scalar dtype's answer is kept once found.
"""

from __future__ import annotations

import functools


def interpret_faster() -> None:
    """Both shortcuts below (each leaves the interpreter as it is where its internals differ)."""
    swap_the_language_once_per_launch()
    look_up_numpy_dtypes_once()


def swap_the_language_once_per_launch() -> None:
    """Patch Triton's interpreter (if it has the internals this relies on; else leave it be)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None or hasattr(executor, "_swapped_once"):
        return
    swapped_in_launch: list[set[int]] = []  # the launch in flight's swapped globals, if one is

    @functools.wraps(patch_lang)
    def patch_lang_once(fn):
        if not swapped_in_launch:
            return patch_lang(fn)
        seen, key = swapped_in_launch[-1], id(fn.__globals__)  # a swap covers what the globals hold
        if key in seen:
            return scope_type()  # nothing swapped: nothing to restore
        seen.add(key)
        return patch_lang(fn)

    launch = executor.__call__

    @functools.wraps(launch)
    def launch_swapping_once(self, *args, **kwargs):
        swapped_in_launch.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped_in_launch.pop()

    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch_swapping_once
    executor._swapped_once = True


def look_up_numpy_dtypes_once() -> None:
    """Keep the interpreter's numpy dtype of each scalar Triton dtype (a block's is its element's;
    pointers, unhashable, are looked up as before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    look_up = getattr(interpreter, "_get_np_dtype", None)
    if look_up is None or hasattr(look_up, "_kept"):
        return
    of_scalar = functools.cache(look_up)

    def numpy_dtype(triton_dtype):
        scalar = triton_dtype.element_ty if isinstance(triton_dtype, tl.block_type) else triton_dtype
        return look_up(scalar) if isinstance(scalar, tl.pointer_type) else of_scalar(scalar)

    numpy_dtype._kept = True
    interpreter._get_np_dtype = numpy_dtype
