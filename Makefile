# The two commands of the README: `make demo` and `make test`. Each creates .venv and
# installs flowq with its dev extras first, so a fresh machine needs only python3 and make.
# `make test` and `make bench` also install the benchmark (bench/, the flowq-bench
# distribution, kept out of the flowq wheel) into the same .venv: tests/acceptance/test_bench.py
# runs it. `make bench BENCH_ARGS="--quick"` passes options on (docs/benchmarks.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flowq-installed
BENCH_STAMP := $(VENV)/.flowq-bench-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@echo "Installing flowq and its dev extras into $(VENV) (once; about a minute)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -U pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# No build isolation: hatchling comes with the dev extras, so this works offline.
$(BENCH_STAMP): $(STAMP) bench/pyproject.toml
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ./bench
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(BIN)/flowq demo

test: $(BENCH_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit loop: every test but those marked `slow` (real worker processes, faults, builds;
# tests/conftest.py names them). `make test` still runs everything, and CI calls it.
.PHONY: test-quick
test-quick: $(BENCH_STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check flowq bench tests examples alembic
	$(BIN)/mypy

bench: $(BENCH_STAMP)
	$(BIN)/flowq bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
