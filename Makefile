# Two entry points for a fresh machine:
#   make serve   set everything up, then serve the default model on :8000
#   make test    set everything up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; GPU nodes take the CUDA build from PyPI.
TORCH_CPU := torch==2.13.0

.PHONY: setup serve test test-slow test-integration test-all lint bench docs clean-venv tools

setup: $(VENV)/.installed model

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q $(TORCH_CPU); fi
	$(PIP) install -q -e '.[dev]'
	touch $@

.PHONY: model
model: $(VENV)/.installed
	$(VENV)/bin/specserve fetch-model

serve: setup
	$(VENV)/bin/specserve serve $(ARGS)

# Debian's prometheus package (needs root: `sudo make tools`): promtool checks
# deploy/prometheus/prometheus.yml and the dashboard's PromQL in the tests; prometheus
# itself scrapes a live server in test-integration. Without it those tests skip.
# No test target depends on it, so `make test` never needs root; CI runs it first.
tools:
	command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# Tests and benchmarks run with Intel's OpenMP preloaded, as `specserve` runs itself (server/openmp.py).
RUN := $(PY) -m server.openmp $(PY)

test: setup
	$(RUN) -m pytest -q $(ARGS)

test-slow: setup
	$(RUN) -m pytest -q -m slow $(ARGS)

test-integration: setup
	$(RUN) -m pytest -q -m integration $(ARGS)

# Every test, whatever its markers.
test-all: setup
	$(RUN) -m pytest -q -m 'slow or not slow' $(ARGS)

# ruff, with the settings in pyproject.toml (installed by setup through the dev extra).
lint: setup
	$(VENV)/bin/ruff check .

# `make bench` lists the benchmarks; `make bench ARGS="NAME [FLAGS]"` runs one.
bench: setup
	$(RUN) -m bench $(ARGS)

# The docs site (mkdocs, material theme) into site/, warnings as errors.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)
