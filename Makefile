# Two entry points for a fresh machine:
#   make serve   set everything up, then serve the default model on :8000
#   make test    set everything up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk. A GPU node (nvidia-smi on PATH) gets the
# image's torch and flash-attn wheel, read from the Dockerfile's ARGs, so `make serve` there is the image.
TORCH_CPU := torch==2.13.0
docker_arg = $(shell sed -n 's/^ARG $(1)=//p' Dockerfile)
TORCH_GPU := torch==$(call docker_arg,TORCH_VERSION)
TORCH_GPU_INDEX := $(call docker_arg,TORCH_INDEX_URL)
FLASH_ATTN := $(call docker_arg,FLASH_ATTN_VERSION)

.PHONY: setup serve test test-slow test-integration test-all lint bench docs clean-venv tools

setup: $(VENV)/.installed model

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q --index-url $(TORCH_GPU_INDEX) $(TORCH_GPU) \
	  && { $(PIP) install -q --no-deps "$$($(PY) deploy/flash_attn_wheel.py $(FLASH_ATTN))" \
	       || echo "no flash-attn wheel for this torch: the engine serves with the torch_varlen backend"; }; \
	else $(PIP) install -q $(TORCH_CPU); fi
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
