"""The serving side reaches the engine through its public API only: ``engine`` itself (the names in
engine/__init__.py), and of its modules only those that hold what crosses the boundary and load no
model code: ``engine.types`` (options, results, priorities), ``engine.config`` (EngineConfig, part of
the app's config) and ``engine.errors`` (the error types the ingress turns into status codes). The
engine's insides can then move without the deployments noticing.

Read from the source (AST), as tests/test_layout.py reads it: every import counts, at module level
and inside functions alike.
"""

from __future__ import annotations

import ast
import importlib

import pytest

import engine
from tests.support.paths import REPO_ROOT

SERVING_PACKAGES = ("deployments",)
ENGINE_MODULES_ALLOWED = {"engine", "engine.types", "engine.config", "engine.errors"}


def engine_imports() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, engine module, names imported from it) for every import of the engine."""
    found = []
    for package in SERVING_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            where = str(path.relative_to(REPO_ROOT))
            for node in ast.walk(ast.parse(path.read_text(), filename=where)):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name == "engine" or alias.name.startswith("engine."):
                            found.append((where, node.lineno, alias.name, []))
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module == "engine" or node.module.startswith("engine."):
                        found.append((where, node.lineno, node.module, [a.name for a in node.names]))
    return found


def test_the_deployments_import_no_engine_module_but_its_public_ones():
    imports = engine_imports()
    assert imports, "no engine import found: is the source where this test looks?"
    outside = [
        f"{where}:{line} imports {module}"
        for where, line, module, _ in imports
        if module not in ENGINE_MODULES_ALLOWED
    ]
    assert not outside, "import these through `engine` (add the name to engine/__init__.py):\n" + "\n".join(
        outside
    )


def test_every_name_the_deployments_take_from_engine_is_in_its_public_api():
    unknown = [
        f"{where}:{line} imports {name}"
        for where, line, module, names in engine_imports()
        if module == "engine"
        for name in names
        if name not in engine.__all__
    ]
    assert not unknown, "add these to engine/__init__.py's public names:\n" + "\n".join(unknown)


@pytest.mark.parametrize("name", engine.__all__)
def test_every_public_name_of_the_engine_resolves(name):
    """A module moved inside the engine must leave its public names where they were."""
    assert getattr(importlib.import_module("engine"), name) is not None
