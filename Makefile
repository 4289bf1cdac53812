# ferrus — developer targets
#
#   make ferrus.py    build ferrus.py, the one file users get, from src/ferrus/*.py
#                     (tools/amalgamate.py; run it after every change there and commit both)
#   make test         run the test suite: pytest -q, split across the CPUs by
#                     tools/run_tests.py (FERRUS_TEST_JOBS=1 for one pytest); fails if
#                     nothing is collected; with COVERAGE=1 it is `make coverage`
#   make coverage     run the suite under coverage.py (subprocesses too), print the
#                     uncovered regions of ferrus.py; fails under the floor in .coveragerc
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
COVERAGE_REPORT_ARGS ?=

.PHONY: test coverage test-matrix bench fuzz e2e clean require-pytest require-coverage check-built

# The generated single file: rebuilt when any module changed (or with -B).
ferrus.py: tools/amalgamate.py $(wildcard src/ferrus/*.py)
	$(PYTHON) tools/amalgamate.py

# Fails when the committed ferrus.py is not what src/ferrus/ builds (CI runs it).
check-built:
	$(PYTHON) tools/amalgamate.py --check

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
# `make test COVERAGE=1` is `make coverage` (CI runs it that way).
ifeq ($(COVERAGE),1)
test: coverage
else
test: require-pytest
	$(PYTHON) tools/run_tests.py $(PYTEST_ARGS)
endif

test-matrix:
	bash .ci/test-matrix

# coverage.py is for the tests only (ferrus.py never imports it).  7.10+ measures
# the ferrus processes the tests start (serve, run, hq, the launcher) through
# `patch = subprocess` in .coveragerc.  It is installed into $(PYTHON) when that
# is a virtual environment; a system Python is left alone.
COVERAGE_MIN := 7.10
require-coverage: require-pytest
	@$(PYTHON) -c "import coverage, sys; sys.exit(tuple(map(int, coverage.__version__.split('.')[:2])) < (7, 10))" 2>/dev/null || { \
	  if $(PYTHON) -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then \
	    echo "make: installing coverage>=$(COVERAGE_MIN) into $(PYTHON) (test-only tool)"; \
	    $(PYTHON) -m pip install -q "coverage>=$(COVERAGE_MIN)" || { \
	      echo "make: coverage.py could not be installed (no network or package index?), so nothing was measured" >&2; \
	      echo "hint: install it by hand: $(PYTHON) -m pip install 'coverage>=$(COVERAGE_MIN)'" >&2; \
	      echo "      or run the tests without measuring them: make test" >&2; \
	      exit 1; }; \
	  else \
	    echo "make: coverage.py $(COVERAGE_MIN)+ is not installed for $(PYTHON), which is not a virtual environment (left alone)" >&2; \
	    echo "hint: python3 -m venv .venv && .venv/bin/python -m pip install pytest 'coverage>=$(COVERAGE_MIN)' && make coverage" >&2; \
	    echo "      or: $(PYTHON) -m pip install 'coverage>=$(COVERAGE_MIN)'" >&2; \
	    exit 1; \
	  fi; }

# The same tests as `make test`, under coverage; the data of every process goes
# to .coverage-data/ and is combined there.  Only this checkout's ferrus.py is
# measured (--include is absolute: tests that copy ferrus.py elsewhere do not
# count).  The test status wins over the floor's.
COVERAGE_DATA := $(ROOT)/.coverage-data
coverage: require-coverage
	@rm -rf "$(COVERAGE_DATA)" && mkdir -p "$(COVERAGE_DATA)"
	@status=0; \
	$(PYTHON) -m coverage run --rcfile="$(ROOT)/.coveragerc" --data-file="$(COVERAGE_DATA)/coverage" \
	    --include="$(ROOT)/ferrus.py" -m pytest -q tests $(PYTEST_ARGS) || status=$$?; \
	$(PYTHON) -m coverage combine -q --rcfile="$(ROOT)/.coveragerc" --data-file="$(COVERAGE_DATA)/coverage" || exit 2; \
	$(PYTHON) .ci/coverage-report --rcfile="$(ROOT)/.coveragerc" --data-file="$(COVERAGE_DATA)/coverage" $(COVERAGE_REPORT_ARGS) \
	    || { [ $$status -ne 0 ] || status=$$?; }; \
	exit $$status

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
	rm -rf .pytest_cache .coverage-data build dist *.egg-info
