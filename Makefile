# The two commands of the README: `make demo` and `make test`. Both create or reuse .venv.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.paraseek-installed
export PYTHONPATH := $(CURDIR)/src

.PHONY: demo test test-unit test-gpu clean

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(PY) -m paraseek demo

# Two workers when pytest-xdist is installed (the test extra; tests/conftest.py keeps a test file, and all of
# tests/serve, on one worker); serially where it is not (the GPU machine has no network to install it).
XDIST = $$($(PY) -c 'import xdist; print("-n 2 --dist loadgroup")' 2>/dev/null)

# Everything on CPU, in two tiers whose times pytest prints: the unit tier, then the rest (multi-process, server,
# CLI and end-to-end tests) with the 25 slowest tests listed.
test: $(STAMP)
	$(PY) -m pytest -q -m "unit and not gpu" $(XDIST) tests
	$(PY) -m pytest -q -m "not unit and not gpu" --durations=25 $(XDIST) tests

# Before each commit: single-process CPU tests (no multi-process, server or GPU tests).
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "unit and not gpu" $(XDIST) tests

# On the GPU machine: the CUDA-only tests and measurements.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build src/*.egg-info
