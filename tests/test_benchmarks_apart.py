"""Benchmarks stand apart from the tests: no test module imports ``benchmarks`` (what both need lives
in tests/support/), and every script left in benchmarks/ says on ``--help`` what it measures and
what it prints or records: a Python script's argparse description (its docstring), the shell
script's header comment.

The imports are read from the source (AST), at module level and inside functions alike. The scripts'
``--help`` runs in one subprocess for all of them, so torch and the engine are imported once.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def scripts() -> list[Path]:
    """The runnable scripts of benchmarks/: its modules with a ``__main__`` entry."""
    return [path for path in sorted(BENCHMARKS.glob("*.py")) if '__name__ == "__main__"' in path.read_text()]


def test_no_test_module_imports_benchmarks():
    importing = {
        str(path.relative_to(REPO_ROOT)): sorted(
            name for name in _imported_modules(path) if name == "benchmarks" or name.startswith("benchmarks.")
        )
        for path in sorted((REPO_ROOT / "tests").rglob("*.py"))
    }
    assert {path: names for path, names in importing.items() if names} == {}


_RUN_HELP = """
import contextlib, io, json, runpy, sys
printed = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_path(path, run_name="__main__")
    printed[path] = out.getvalue()
print(json.dumps(printed))
"""


def test_every_benchmark_script_describes_itself_on_help():
    paths = scripts()
    assert len(paths) >= 8, paths  # the scripts that reproduce the recorded figures, at least
    done = subprocess.run(
        [sys.executable, "-c", _RUN_HELP, *map(str, paths)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    printed = json.loads(done.stdout.splitlines()[-1])
    for path in paths:
        description = ast.get_docstring(ast.parse(path.read_text()))
        assert description, f"{path.name} has no docstring to describe it"
        first_line = description.splitlines()[0]
        assert printed[str(path)].startswith("usage:"), (path.name, printed[str(path)][:300])
        assert first_line in printed[str(path)], (path.name, printed[str(path)][:300])
        assert "prints" in description.lower(), f"{path.name}'s description does not say what it prints"


def test_the_app_on_a_gpu_script_prints_its_header_on_help():
    script = BENCHMARKS / "run_app_on_gpu.sh"
    done = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, check=True
    )
    header = script.read_text().splitlines()[1].removeprefix("# ")
    assert done.stdout.startswith(header), done.stdout[:300]
    assert "bench_load.py" in done.stdout and "engine_alone.py" in done.stdout
