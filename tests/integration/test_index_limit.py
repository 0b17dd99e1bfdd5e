"""The index's size limit (``index_max_entries``) on a real cluster: every master holds the
whole index, so an index that outgrew their memory would kill them all at once (Mooncake's
master was OOM-killed at 25-50 M objects). At the limit, puts of new keys miss (or raise
IndexFullError in strict mode), overwrites go on, and room made by a remove is taken again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from kvpool import Client
from kvpool.errors import IndexFullError
from kvpool.launcher.cluster import LocalCluster

from .conftest import ClusterFactory

pytestmark = pytest.mark.integration

LIMIT = 8


def _master_sample(cluster: LocalCluster, name: str) -> float:
    (info,) = [i for i in cluster.processes.values() if i.name.startswith("master")]
    with urllib.request.urlopen(f"http://{info.extra['metrics']}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m is not None, f"no sample {name} in the master's scrape"
    return float(m.group(1))


def _status(cluster: LocalCluster, *flags: str) -> str:
    """``kvpool status`` of the cluster's master, as printed."""
    command = [sys.executable, "-m", "kvpool", "status", "--masters", *cluster.master_addresses]
    return subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def test_at_the_limit_new_keys_miss_overwrites_go_on_and_a_remove_makes_room(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        masters=1,
        nodes=1,
        cpu_cache_size="64MiB",
        metrics=True,
        extra_master_flags=["--index-max-entries", str(LIMIT)],
    )
    keys = [f"limit/{i}" for i in range(LIMIT)]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, k.encode() * 100) for k in keys]))
        # Full: a new key is a miss, in a batch too, and says why in strict mode.
        assert not kv.put("limit/new", b"x" * 4096)
        assert kv.batch_put([("limit/new-a", b"a"), ("limit/new-b", b"b")]) == [False, False]
        with pytest.raises(IndexFullError, match="index_max_entries"):
            kv.put("limit/new", b"x" * 4096, strict=True)
        assert not kv.exists("limit/new")
        # What the index holds is still served, and can be written again.
        assert kv.get(keys[0]) == keys[0].encode() * 100
        assert kv.put(keys[0], b"rewritten")
        assert kv.get(keys[0]) == b"rewritten"
        # A remove makes room for one new key.
        assert kv.remove(keys[1])
        assert kv.put("limit/new", b"y" * 4096)
        assert kv.get("limit/new") == b"y" * 4096
        assert not kv.put("limit/newer", b"z")
    assert _master_sample(cluster, "kvpool_index_max_entries") == LIMIT
    assert _master_sample(cluster, "kvpool_index_full_refusals_total") == 4
    assert f"{LIMIT} of {LIMIT} (100% !ALARM)" in _status(cluster)
    report = json.loads(_status(cluster, "--json"))
    assert report["masters"][0]["max_entries"] == LIMIT
