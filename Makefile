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

.PHONY: venv test test-fast bench bench-quick demo proto clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet "$(TORCH_CPU_SPEC)" $(TORCH_PIP_ARGS); \
	fi
	$(PY) -m pip install --quiet -e '.[dev,ucx]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.tiers
	$(PY) -m bench.daemon
	$(PY) -m bench.index
	$(PY) -m bench.transport

bench-quick: $(STAMP)
	$(PY) -m bench.tiers --quick
	$(PY) -m bench.daemon --quick
	$(PY) -m bench.index --quick
	$(PY) -m bench.transport --quick

demo: $(STAMP)
	$(PY) -m kvstore.demo

# The generated modules are committed; run this after editing the .proto. grpcio-tools is
# pinned (pyproject) so that the code it writes runs with the protobuf LMCache allows.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. kvstore/api/v1/kvstore.proto

clean:
	rm -rf $(VENV) build *.egg-info
