# kvpool — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-fast test-slow lint typecheck importcheck proto proto-check deploy-check fmt clean help

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

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info
