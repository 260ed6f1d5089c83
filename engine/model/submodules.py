"""Swapping a module's children by dotted path: how the reduced-precision paths (FP8 on a GPU, bf16
products on a CPU) put their own product in place of an ``nn.Linear``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn


def replace_submodules(
    module: nn.Module, names: Iterable[str], make: Callable[[nn.Module], nn.Module]
) -> int:
    """Replace each child of ``module`` named in ``names`` (dotted paths, e.g. ``mlp.fc1``) by
    ``make(child)``; returns how many were replaced."""
    replaced = 0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, make(getattr(parent, child)))
        replaced += 1
    return replaced
