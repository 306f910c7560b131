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
	$(PY) -m pip install --quiet -e '.[test,dev,data,s3]'
	touch $(STAMP)

$(PLOT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[plot]'
	touch $(PLOT_STAMP)

demo: $(PLOT_STAMP)
	$(VENV)/bin/pitstop demo

# ruff, then the import contracts of pyproject.toml (the doors between pitstop's packages).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/lint-imports --no-logo

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The test files run side by side, one worker per core (at most 4; TEST_WORKERS=0 runs them in
# this process). A file stays on one worker: its module fixtures are computed once.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; f = getattr(os, 'sched_getaffinity', None); \
	print(min(4, len(f(0)) if f else os.cpu_count() or 1))")

unit: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Lint first, then types, then the tests.
test: lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/plan_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
