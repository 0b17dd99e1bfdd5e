# kvpool — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-fast test-slow test-engines test-engines-sglang lint typecheck importcheck proto proto-check deploy-check fmt clean help

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

# --- engine environments: one venv per engine, never .venv (each pins its own torch) ---------
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23

$(SGLANG_STAMP): tests/engines/sglang/requirements.txt pyproject.toml
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r tests/engines/sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_VENV)/bin/python -m pip install --quiet -e .
	@touch $(SGLANG_STAMP)

test-engines: test-engines-sglang  ## every engine's tests, each in its own environment (the pre-release check)

test-engines-sglang: $(SGLANG_STAMP)  ## SGLang 0.5.23's own Mooncake test on kvpool, and the native HiCache backend's conformance suite
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines/sglang

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

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .venv-* .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info
