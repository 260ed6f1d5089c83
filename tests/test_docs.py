"""The generated documentation matches the code it is generated from."""

from __future__ import annotations

import re
import subprocess
import sys

from deployments.config_reference import REGENERATE, render
from tests.support.paths import REPO_ROOT


def test_configuration_page_is_what_the_config_models_generate():
    committed = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), f"docs/configuration.md is out of date; regenerate it: {REGENERATE}"


def test_configuration_page_names_every_field_of_every_section():
    page = render()
    for section, field in [("engine", "block_size"), ("engine.gpu", "cuda_graphs"), ("transfer", "mode")]:
        assert f"## `{section}`" in page
        assert f"| `{field}` |" in page
    assert "| `num_cpus` | float (>= 0) | `0.5` |" in page, "the ingress's own defaults, not ReplicaOptions'"


def test_performance_page_and_its_plots_are_written_from_the_recorded_results(tmp_path):
    script = REPO_ROOT / "benchmarks" / "plot_performance.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, cwd=REPO_ROOT)
    page = (tmp_path / "performance.md").read_text()
    images = sorted(path.name for path in (tmp_path / "images").glob("*.png"))
    assert images, "no plot was written"
    for name in images:
        assert (tmp_path / "images" / name).stat().st_size > 10_000, f"{name} is too small to be a plot"
        assert f"](images/{name})" in page, f"the page does not show {name}"
    committed = (REPO_ROOT / "docs" / "performance.md").read_text()
    assert committed == page, (
        "docs/performance.md is out of date; regenerate it: python benchmarks/plot_performance.py"
    )
    for name in images:
        assert (REPO_ROOT / "docs" / "images" / name).exists(), f"docs/images/{name} is not committed"


def _markdown_pages():
    return [
        REPO_ROOT / "README.md",
        REPO_ROOT / "benchmarks" / "RESULTS.md",
        *sorted((REPO_ROOT / "docs").glob("*.md")),
    ]


def test_every_relative_link_in_the_user_docs_points_at_a_file_that_exists():
    broken = []
    for page in _markdown_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_readme_stays_short():
    lines = len((REPO_ROOT / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; move detail into docs/"
