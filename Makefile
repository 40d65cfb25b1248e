# The two commands a newcomer runs (README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# what the product needs (make demo), and that plus the test extras (make test, bench, docs)
PRODUCT := $(VENV)/.installed-product
TESTING := $(VENV)/.installed-test

.PHONY: demo test bench docs clean

$(PRODUCT): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(PRODUCT)

$(TESTING): $(PRODUCT)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(TESTING)

demo: $(PRODUCT)
	$(BIN)/regen demo

test: $(TESTING)
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest

bench: $(TESTING)
	$(BIN)/python -m tests.bench.run_all

# the reference pages generated from the code (tests/test_reference.py checks them)
docs: $(TESTING)
	$(BIN)/python -m console.reference docs

clean:
	rm -rf $(VENV) .pytest_cache
