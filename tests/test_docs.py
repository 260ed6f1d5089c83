"""The generated documentation matches the code it is generated from."""

from __future__ import annotations

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
