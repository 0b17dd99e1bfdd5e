"""Fixtures that start real kvpool processes on 127.0.0.1 and always stop them (by pid)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.launcher.cluster import LocalCluster

ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start clusters with ``cluster_factory(masters=3, nodes=2, ...)``; all are stopped at
    the end of the test, whatever happened."""
    started: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster-{len(started)}", **kwargs)
        started.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for a whole module of tests that do not inject faults."""
    cluster = LocalCluster(
        tmp_path_factory.mktemp("shared-cluster"), masters=3, nodes=2, cpu_cache_size="512MiB"
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
