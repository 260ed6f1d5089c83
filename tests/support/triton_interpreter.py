"""Triton's CPU interpreter, which runs the engine's kernels in tests, without its repeated set-up
and with its reductions over a combine function of their own done a level at a time.

The interpreter swaps triton.language's functions for interpreted ones around each kernel launch,
and again on every call of a JIT helper inside a kernel (tl.max, tl.sum, ... are such helpers):
each swap walks the language's modules with ``inspect.getmembers``. A kernel that reduces in a
loop, once per program of its grid, spent most of its interpreted time there. Within a launch a
swap changes nothing after the first of the same modules (functions already swapped are left as
they are, and nothing is restored before the launch ends), so here a launch swaps the modules a
function sees at its first call only. Every operation of a kernel is still interpreted as it was.

``tl.reduce`` with a combine function of the kernel's own (not tl.sum's or tl.max's, which the
interpreter hands to NumPy) calls that function once per element, on scalars each wrapped and
unwrapped in turn: a product whose programs each reduce their row ran mostly there. Triton asks of
the combine function only that it be associative, and a GPU reduces in a tree; here too, combining
neighbours pairwise, a level of the tree in one interpreted call on whole slices.

Each interpreted operation also looks up the numpy dtype of its Triton dtype, and the lookup builds
its table of every dtype anew on each call: here a scalar dtype's answer is kept once found.
"""

from __future__ import annotations

import functools

import numpy as np


def interpret_faster() -> None:
    """The shortcuts below (each leaves the interpreter as it is where its internals differ)."""
    swap_the_language_once_per_launch()
    reduce_a_level_at_a_time()
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


def reduce_a_level_at_a_time() -> None:
    """Patch the interpreter's reduction over a combine function (if it has the internals this
    relies on; else leave it be): neighbours combined pairwise, each level of the tree in one call
    (a block's dimensions are powers of two)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    if reduce_ops is None or not hasattr(reduce_ops, "generic_reduce") or hasattr(reduce_ops, "_by_levels"):
        return

    def reduce_by_levels(self, inputs):
        dtypes = [tensor.dtype for tensor in inputs]
        unravelled, axis = self.unravel(inputs, self.axis)
        level = [tensor.handle.data for tensor in unravelled]
        while (length := level[0].shape[axis]) > 1:
            evens, odds = (
                [
                    self.to_tensor(np.take(data, np.arange(first, length, 2), axis), dtype)
                    for data, dtype in zip(level, dtypes)
                ]
                for first in (0, 1)
            )
            combined = self.combine_fn.fn(*evens, *odds)
            combined = combined if isinstance(combined, tuple) else (combined,)
            shape = evens[0].handle.data.shape
            level = [
                np.broadcast_to(result.handle.data if hasattr(result, "handle") else result, shape).astype(
                    data.dtype
                )
                for result, data in zip(combined, level)
            ]
        reduced = []
        for data, dtype in zip(level, dtypes):
            if self.keep_dims and self.axis is None:
                data = data.reshape((1,) * inputs[0].handle.data.ndim)
            elif not self.keep_dims:
                data = np.squeeze(data, axis) if self.axis is not None else data.reshape(()).item()
            reduced.append(self.to_tensor(data, dtype))
        return reduced

    reduce_ops.generic_reduce = reduce_by_levels
    reduce_ops._by_levels = True


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
