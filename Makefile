# The two commands a fresh clone needs: `make serve` and `make test`. Both create .venv first.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-test lint test test-fast serve bench docs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	touch $@

install-test: $(VENV)/.installed-test

# Every test, as CI runs it (.ci/run).
lint: install-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# Every test, as CI runs it (.ci/run), on three workers for two cores: one runs the modules that
# start Ray, the other two every other module at the lowest CPU priority, so they use what the app's
# processes leave, a whole core while a Ray test waits on a stream paced in real time or an idle
# app (tests/conftest.py). The slowest 30 tests are listed at the end.
test: lint
	$(PY) -m pytest -q -n 3 --durations=30 tests

# The quick loop while editing: no Ray, no GPU, none of the long CPU tests.
test-fast: lint
	$(PY) -m pytest -q -n 2 -m "not slow and not ray and not gpu" tests

serve: install
	$(VENV)/bin/serve run configs/default.yaml

bench: install-test
	$(PY) benchmarks/bench_offline.py

# The generated pages: the configuration reference from the pydantic models, the performance page's
# plots and tables from benchmarks/results/*.json (tests/test_docs.py checks both are current).
docs: install-test
	$(PY) -m deployments.config_reference > docs/configuration.md
	$(PY) benchmarks/plot_performance.py
