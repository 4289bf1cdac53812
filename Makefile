# ferrus — developer targets
#
#   make test         run the test suite (pytest -q tests); fails if nothing is collected
#   make test-matrix  run the suite on every CPython 3.9+ found (pyenv / PATH), see .ci/test-matrix
#   make bench        run the benchmark: bench/run.py $(BENCH_ARGS)
#   make fuzz         run the fuzz tests with FERRUS_FUZZ_N=$(N) cases (default 2000)
#   make e2e          run only the end-to-end tests (pytest -m e2e)
#   make clean        remove caches and build output
#
# Extra pytest options for test/fuzz/e2e: make test PYTEST_ARGS='-x -k resume'
#
# PYTHON is .venv/bin/python when that exists in the repo (created by .ci/run
# or by hand), python3 otherwise; override with `make test PYTHON=python3.12`.

ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

ifneq ($(wildcard $(ROOT)/.venv/bin/python),)
PYTHON ?= $(ROOT)/.venv/bin/python
else
PYTHON ?= python3
endif

# Using the repo's .venv: run as if it were activated, so tests that start
# `python3` or ./ferrus (#!/usr/bin/env python3) get the same interpreter.
ifeq ($(PYTHON),$(ROOT)/.venv/bin/python)
export PATH := $(ROOT)/.venv/bin:$(PATH)
export VIRTUAL_ENV := $(ROOT)/.venv
endif

N ?= 2000
BENCH_ARGS ?=
PYTEST_ARGS ?=

.PHONY: test test-matrix bench fuzz e2e clean require-pytest

# pytest is the only test dependency; without it, say how to get it instead of
# pytest's bare "No module named pytest".
require-pytest:
	@$(PYTHON) -c "import pytest" 2>/dev/null || { \
	  echo "make: pytest is not installed for $(PYTHON) (it is the only test dependency)" >&2; \
	  echo "hint: $(PYTHON) -m pip install pytest" >&2; \
	  echo "      or, in a virtual environment make finds by itself:" >&2; \
	  echo "      python3 -m venv .venv && .venv/bin/python -m pip install pytest && make test" >&2; \
	  exit 1; }

# pytest's exit status is make's: 1 = failures, 5 = no tests collected, ...
test: require-pytest
	$(PYTHON) -m pytest -q tests $(PYTEST_ARGS)

test-matrix:
	bash .ci/test-matrix

# Agents start `ferrus serve` from cached bytecode; a PYTHONDONTWRITEBYTECODE
# inherited from the shell would stop that cache from ever being written.
bench:
	env -u PYTHONDONTWRITEBYTECODE $(PYTHON) bench/run.py $(BENCH_ARGS)

fuzz: require-pytest
	FERRUS_FUZZ_N=$(N) $(PYTHON) -m pytest -q tests/test_fuzz.py $(PYTEST_ARGS)

e2e: require-pytest
	$(PYTHON) -m pytest -q -m e2e tests $(PYTEST_ARGS)

clean:
	find . \( -path ./.git -o -path ./.venv -o -path ./.matrix \) -prune \
	    -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache build dist *.egg-info
