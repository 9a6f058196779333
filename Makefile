# One command each: `make run` (the local stack) and `make test`. Both run `setup` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STUBS := libs/pdserve/proto/v1/__init__.py
PROTOS := $(wildcard protos/pdserve/v1/*.proto)
# buf (npm @bufbuild/buf, pinned in package-lock.json) checks the contracts in `make lint`.
BUF := node_modules/.bin/buf
BUF_STAMP := node_modules/.installed
# `buf breaking` compares protos/ with the released v1 contracts: a buf image committed in the
# repo (works offline, in any clone, shallow ones too). Refresh it at a release with
# `make proto-baseline`. Any buf input can stand in: BUF_AGAINST='.git#tag=v1.0.0,subdir=protos'.
BUF_AGAINST ?= protos/v1-baseline.json

.PHONY: setup protos proto-baseline run test chaos lint bench clean gpu-bundle device-check images

setup: .setup-stamp $(STUBS) $(BUF_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's dependency list changes. torch first, the build for this
# machine (scripts/torch_spec.sh: the CPU build unless an NVIDIA driver is present).
.setup-stamp: pyproject.toml scripts/torch_spec.sh | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $$(scripts/torch_spec.sh)
	$(PIP) install --quiet -e '.[test,dev,bench,local,controller,fast]'
	$(PY) -c "from pdserve.attention import cpu_decode; cpu_decode.main()"
	touch $@

protos $(STUBS): $(PROTOS) scripts/gen_protos.py | .setup-stamp
	$(PY) scripts/gen_protos.py

$(BUF_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

# The contracts as released, for `buf breaking` (run at a release, then commit the file).
proto-baseline: $(BUF_STAMP) | .setup-stamp
	$(BUF) build --exclude-source-info -o '-#format=json' | $(PY) -m json.tool --indent 1 \
		> protos/v1-baseline.json

run: setup
	$(VENV)/bin/pdserve up --model tiny --prefill 1 --decode 1

test: setup
	$(PY) -m pytest -q

# The long chaos cases (tests/chaos, marked slow): kills and pauses of live stacks.
chaos: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check libs services tests scripts
	$(VENV)/bin/mypy libs/pdserve libs/pdserve_bench services
	$(BUF) lint
	$(BUF) breaking --against '$(BUF_AGAINST)'

bench: setup
	$(VENV)/bin/pdserve bench all

# The device check (docs/benchmarks.md): build the bundle where PyPI is reachable, then run
# `make device-check` (or scripts/device_check.sh) on the GPU machine.
gpu-bundle: setup
	$(PY) scripts/gpu_bundle/build.py

device-check:
	scripts/device_check.sh

# Every image (deploy/Dockerfile), tagged pdserve/<target>:$(TAG): needs docker with buildx.
TAG ?= 0.1.0
images:
	TAG=$(TAG) docker buildx bake -f deploy/docker-bake.hcl

clean:
	rm -rf $(VENV) .setup-stamp .gpu-bundle device-check-out libs/pdserve/proto/v1 build *.egg-info \
		.pytest_cache .mypy_cache .ruff_cache node_modules
