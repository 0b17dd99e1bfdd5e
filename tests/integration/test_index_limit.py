"""The index's size limit (``index_max_entries``) on a real cluster: every master holds the
whole index, so an index that outgrew their memory would kill them all at once (Mooncake's
master was OOM-killed at 25-50 M objects). At the limit, puts of new keys miss (or raise
IndexFullError in strict mode), overwrites go on, and room made by a remove is taken again.
With ``index_shed`` (the default) the leader also asks the nodes to drop their coldest blocks
past nine tenths of the limit, so that new keys keep getting in."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from kvpool import Client
from kvpool.errors import IndexFullError
from kvpool.launcher.cluster import LocalCluster

from .conftest import ClusterFactory

pytestmark = pytest.mark.integration

LIMIT = 8


def _sample(cluster: LocalCluster, name: str, role: str = "master") -> float:
    (info,) = [i for i in cluster.processes.values() if i.name.startswith(role)]
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
        extra_master_flags=["--index-max-entries", str(LIMIT), "--no-index-shed"],
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
    assert _sample(cluster, "kvpool_index_max_entries") == LIMIT
    assert _sample(cluster, "kvpool_index_full_refusals_total") == 4
    assert f"{LIMIT} of {LIMIT} (100% !ALARM)" in _status(cluster)
    report = json.loads(_status(cluster, "--json"))
    assert report["masters"][0]["max_entries"] == LIMIT


def test_past_nine_tenths_the_nodes_drop_their_coldest_blocks_and_new_keys_get_in(
    cluster_factory: ClusterFactory,
) -> None:
    """A full index freezes what the cache holds unless blocks leave it: with index_shed the
    leader's heartbeat answers ask the node for room, the node drops its coldest blocks (never
    read here) and reports them, and the next new keys are stored; the blocks read stay."""
    limit = 10
    cluster = cluster_factory(
        masters=1,
        nodes=1,
        cpu_cache_size="64MiB",
        metrics=True,
        extra_master_flags=["--index-max-entries", str(limit), "--heartbeat-interval-s", "0.2"],
    )
    cold = [f"shed/cold/{i}" for i in range(3)]
    hot = [f"shed/hot/{i}" for i in range(limit - len(cold))]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, k.encode() * 50) for k in cold]))
        assert all(kv.batch_put([(k, k.encode() * 50) for k in hot]))
        for _ in range(3):
            assert kv.batch_get(hot) == [k.encode() * 50 for k in hot]
        # The index is full: the node is asked to shed, and the cold blocks go first.
        new = [f"shed/new/{i}" for i in range(len(cold))]
        stored: list[str] = []
        deadline = time.monotonic() + 20
        while len(stored) < len(new) and time.monotonic() < deadline:
            key = new[len(stored)]
            if kv.put(key, key.encode() * 50):
                stored.append(key)
            else:
                time.sleep(0.1)
        assert stored == new, "new keys never got into the full index"
        assert kv.batch_exists(cold) == [False] * len(cold)
        assert kv.batch_get(hot) == [k.encode() * 50 for k in hot]
        assert kv.batch_get(new) == [k.encode() * 50 for k in new]
    assert _sample(cluster, "kvpool_index_shed_asked_total") >= len(cold)
    assert _sample(cluster, "kvpool_node_index_shed_total", "node") >= len(cold)
    assert _sample(cluster, "kvpool_index_entries") <= limit
