# The two commands of the README: `make demo` and `make test`. Each creates .venv and
# installs flowq with its dev extras first, so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flowq-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -U pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flowq demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit loop: every test but those marked `slow` (real worker processes, faults, builds;
# tests/conftest.py names them). `make test` still runs everything, and CI calls it.
.PHONY: test-quick
test-quick: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check flowq tests examples alembic
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/flowq bench

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
