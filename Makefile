# One command each: `make run` (the local stack) and `make test`. Both run `setup` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STUBS := libs/pdserve/proto/v1/__init__.py
PROTOS := $(wildcard protos/pdserve/v1/*.proto)

.PHONY: setup protos run test lint bench clean gpu-bundle device-check

setup: .setup-stamp $(STUBS)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's dependency list changes.
.setup-stamp: pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,dev,bench]'
	touch $@

protos $(STUBS): $(PROTOS) scripts/gen_protos.py | .setup-stamp
	$(PY) scripts/gen_protos.py

run: setup
	$(VENV)/bin/pdserve up --model tiny --prefill 1 --decode 1

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check libs services tests scripts
	$(VENV)/bin/mypy libs/pdserve libs/pdserve_bench services

bench: setup
	$(VENV)/bin/pdserve bench all

# The device check (docs/benchmarks.md): build the bundle where PyPI is reachable, then run
# `make device-check` (or scripts/device_check.sh) on the GPU machine.
gpu-bundle: setup
	$(PY) scripts/gpu_bundle/build.py

device-check:
	scripts/device_check.sh

clean:
	rm -rf $(VENV) .setup-stamp .gpu-bundle device-check-out libs/pdserve/proto/v1 build *.egg-info .pytest_cache .mypy_cache .ruff_cache
