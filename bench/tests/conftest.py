"""The benchmarks' tests share the integration tests' fixtures that start real kvpool processes
on 127.0.0.1 and always stop them."""

from __future__ import annotations

from tests.integration.conftest import shared_cluster

__all__ = ["shared_cluster"]
