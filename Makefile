# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv once (torch pinned to 2.13.0; this workplace's wheel cache holds its CPU
# build) and reuse it afterwards. `make demo` also installs the `plot` extra (matplotlib), so it
# draws runs/demo/resume.png; `make test` does not need it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PLOT_STAMP := $(VENV)/.installed-plot

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

$(PLOT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[plot]'
	touch $(PLOT_STAMP)

demo: $(PLOT_STAMP)
	$(VENV)/bin/pitstop demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

# Lint first, then types, then the tests.
test: lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/plan_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
