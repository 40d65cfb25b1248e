# The two commands a newcomer runs (README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/regen demo

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m tests.bench.run_all

# the reference pages generated from the code (tests/test_reference.py checks them)
docs: $(STAMP)
	$(BIN)/python -m console.reference docs

clean:
	rm -rf $(VENV) .pytest_cache
