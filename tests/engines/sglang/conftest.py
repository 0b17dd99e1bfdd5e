"""SGLang engine tests: run in the SGLang environment (``make test-engines-sglang``).

Elsewhere (the project's own ``.venv``) every test here is skipped: SGLang is not installed
there, on purpose (it pins torch and pulls GPU packages).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.launcher.cluster import LocalCluster

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
collect_ignore_glob = [] if HAS_SGLANG else ["test_*.py"]


@pytest.fixture(scope="module")
def sglang_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A kvpool cluster (3 masters, 2 nodes) for a module of SGLang tests."""
    cluster = LocalCluster(
        Path(tmp_path_factory.mktemp("sglang-cluster")),
        masters=3,
        nodes=2,
        cpu_cache_size="512MiB",
        in_memory=True,
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
