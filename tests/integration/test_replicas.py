"""Hot-block replicas, pins, repair and drain against a real local cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import AsyncClient, Client
from kvpool.errors import PinQuotaExceededError
from kvpool.grpcutil import call_once_sync
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import master_pb2, master_pb2_grpc

from .conftest import ClusterFactory

pytestmark = pytest.mark.integration

FAST_MASTER = [
    "--hot-reads-per-s", "20",
    "--hot-half-life-s", "1s",
    "--hot-max-replicas", "3",
    "--restore-grace-s", "30s",
]  # fmt: skip


def _value(key: str, size: int = 16384) -> bytes:
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


def replica_status(cluster: LocalCluster, keys: list[str]) -> master_pb2.ReplicaStatusResponse:
    response: master_pb2.ReplicaStatusResponse = call_once_sync(
        cluster.wait_for_leader(),
        master_pb2_grpc.MasterStub,
        "ReplicaStatus",
        master_pb2.ReplicaStatusRequest(keys=keys),
        timeout_s=5.0,
        security=cluster.security,
    )
    return response


def wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout_s} s")


def live_node_ids(cluster: LocalCluster) -> set[str]:
    response = call_once_sync(
        cluster.wait_for_leader(),
        master_pb2_grpc.MasterStub,
        "GetMembers",
        master_pb2.GetMembersRequest(),
        timeout_s=5.0,
    )
    return {m.node_id for m in response.members}


def holder_names(kv: Client, cluster: LocalCluster, key: str) -> list[str]:
    """Node names holding ``key`` (as the index lists them), via a lookup."""
    response = call_once_sync(
        cluster.wait_for_leader(),
        master_pb2_grpc.MasterStub,
        "Lookup",
        master_pb2.LookupRequest(keys=[key]),
        timeout_s=5.0,
    )
    names = {m.member_id: m.node_id for m in response.members}
    return [names[m] for m in response.entries[0].replicas]


def test_a_hot_key_gains_replicas_and_survives_its_holder_dying(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        masters=3, nodes=3, cpu_cache_size="128MiB", extra_master_flags=FAST_MASTER
    )
    key = "hot/system-prompt/0"
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert kv.put(key, _value(key))
        assert replica_status(cluster, [key]).replicas == [1]
        started = time.monotonic()
        while replica_status(cluster, [key]).replicas[0] < 3:
            for _ in range(20):
                assert kv.get(key) == _value(key)
            assert time.monotonic() - started < 20, "the hot key did not reach 3 replicas"
        assert key in replica_status(cluster, [key]).hot_keys
        # Kill the original holder: every read keeps hitting.
        original = holder_names(kv, cluster, key)[0]
        cluster.kill(original)
        misses = sum(kv.get(key) != _value(key) for _ in range(200))
        assert misses == 0
    # After the kill is declared, the index lists only live holders.
    wait_until(
        "the dead holder leaves the entry",
        lambda: original not in holder_names(kv, cluster, key),
        timeout_s=15,
    )


def test_a_hot_key_that_cools_down_is_released_to_its_put_count(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        masters=1, nodes=3, cpu_cache_size="128MiB", extra_master_flags=FAST_MASTER
    )
    key = "hot/cooling/0"
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert kv.put(key, _value(key))
        started = time.monotonic()
        while replica_status(cluster, [key]).replicas[0] < 3:
            for _ in range(20):
                assert kv.get(key) == _value(key)
            assert time.monotonic() - started < 20, "the hot key did not reach 3 replicas"
        # No more reads: the decayed rate halves every second; below 10 reads/s it is released.
        wait_until(
            "the cooled key back at 1 replica",
            lambda: replica_status(cluster, [key]).replicas == [1],
            timeout_s=15,
        )
        assert replica_status(cluster, [key]).releases_total == 2
        assert kv.get(key) == _value(key)


def test_pins_keep_replicas_and_have_a_quota(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        masters=1,
        nodes=3,
        cpu_cache_size="128MiB",
        extra_master_flags=["--pin-quota", "100KiB"],
    )
    keys = [f"pin/{i}" for i in range(3)]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        assert kv.pin(keys[:2], replicas=2) == [True, True]  # 2 x 16 KiB x 2 = 64 KiB
        assert kv.pin(["pin/absent"], replicas=2) == [False]
        with pytest.raises(PinQuotaExceededError, match="pin quota exceeded"):
            kv.pin(keys[2:], replicas=3)  # +48 KiB > 100 KiB
        wait_until(
            "pinned keys reach 2 replicas",
            lambda: replica_status(cluster, keys).replicas == [2, 2, 1],
            timeout_s=10,
        )
        assert replica_status(cluster, keys).pinned_bytes == 2 * 2 * 16384
        assert kv.unpin(keys[:1]) == [True]
        assert replica_status(cluster, keys).pinned_bytes == 2 * 16384


def test_node_to_node_copies_offer_the_cluster_token(cluster_factory: ClusterFactory) -> None:
    # With a cluster token every data connection must authenticate, node-to-node copies too:
    # a pin to 2 replicas is only reached if the holder can read itself and write the target.
    cluster = cluster_factory(masters=1, nodes=2, cpu_cache_size="64MiB", cluster_token=True)
    keys = [f"secured-pin/{i}" for i in range(4)]
    with Client(
        cluster.master_addresses, timeout_s=5.0, cluster_token_file=cluster.token_file
    ) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        assert kv.pin(keys, replicas=2) == [True] * len(keys)
        wait_until(
            "pinned keys reach 2 replicas on a token cluster",
            lambda: replica_status(cluster, keys).replicas == [2] * len(keys),
            timeout_s=15,
        )
        assert [kv.get(k) for k in keys] == [_value(k) for k in keys]


def test_a_pinned_block_outlives_eviction_pressure(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        masters=1, nodes=1, cpu_cache_size="16MiB", extra_node_flags=["--max-block-size", "1MiB"]
    )
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        size = 256 << 10
        assert kv.put("pinned/0", _value("pinned/0", size))
        assert kv.put("unpinned/0", _value("unpinned/0", size))
        assert kv.pin(["pinned/0"], replicas=1) == [True]
        time.sleep(1.0)  # the replica loop tells the node within a round (0.2 s)
        for i in range(100):  # 25 MiB through a 16 MiB tier
            kv.put(f"flood/{i}", _value(f"flood/{i}", size))
        assert kv.get("unpinned/0") is None  # evicted: the pressure was real
        assert kv.get("pinned/0") == _value("pinned/0", size)


def test_replica_counts_return_to_target_after_a_node_kill(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(masters=1, nodes=4, cpu_cache_size="128MiB")
    keys = [f"repair/{i}" for i in range(300)]
    with Client(cluster.master_addresses, timeout_s=5.0, replicas=2) as kv:
        assert all(kv.batch_put([(k, _value(k, 4096)) for k in keys]))
        assert set(replica_status(cluster, keys).replicas) == {2}
        victim = cluster.node_names[0]
        killed = time.monotonic()
        cluster.kill(victim)
        wait_until(
            "the killed node declared down",
            lambda: victim not in live_node_ids(cluster),
            timeout_s=cluster.node_timeout_s + 10,
        )
        declared = time.monotonic() - killed
        took = wait_until(
            "every block back at 2 replicas",
            lambda: set(replica_status(cluster, keys).replicas) == {2},
            timeout_s=15,
        )
        assert kv.batch_get(keys) == [_value(k, 4096) for k in keys]
        assert all(victim not in holder_names(kv, cluster, k) for k in keys[:20])
        print(f"declared down after {declared:.2f} s, repaired {took:.2f} s later")


def test_drain_hands_every_block_over_then_leaves(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(masters=1, nodes=3, cpu_cache_size="128MiB")
    keys = [f"drain/{i}" for i in range(200)]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, _value(k, 4096)) for k in keys]))
        victim = cluster.node_names[0]
        response = call_once_sync(
            cluster.wait_for_leader(),
            master_pb2_grpc.MasterStub,
            "DrainNode",
            master_pb2.DrainNodeRequest(node_id=victim, wait=True),
            timeout_s=30.0,
        )
        assert response.blocks_left == 0
        assert response.left
        cluster.terminate(victim)
        assert kv.batch_get(keys) == [_value(k, 4096) for k in keys]
        assert set(replica_status(cluster, keys).replicas) == {1}


def test_a_paused_replica_costs_a_hedge_not_a_deadline(cluster_factory: ClusterFactory) -> None:
    # SIGSTOP one of two nodes (for less than the node timeout: it stays in the index): every
    # get of keys held on both keeps hitting, each within a small part of its 2 s deadline.
    # Over tcp: over shared memory a paused node's blocks are read through its directory, with
    # no message, until it has not renewed it for a second (test_directory).
    cluster = cluster_factory(masters=1, nodes=2, cpu_cache_size="64MiB")
    keys = [f"paused/{i}" for i in range(10)]
    with Client(cluster.master_addresses, timeout_s=2.0, replicas=2, transport="tcp") as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        assert [kv.get(k) for k in keys] == [_value(k) for k in keys]
        victim = cluster.node_names[0]
        cluster.pause(victim)
        try:
            worst = 0.0
            for _ in range(10):
                for k in keys:
                    started = time.monotonic()
                    assert kv.get(k) == _value(k)
                    worst = max(worst, time.monotonic() - started)
        finally:
            cluster.resume(victim)
        assert worst < 0.5, f"a get waited {worst:.3f} s for the paused node"
        assert kv.stats["hedged_reads"] >= 1
        assert kv.stats["misses"] == 0


@pytest.mark.parametrize("flavour", ["Client", "AsyncClient"])
def test_a_stopped_node_costs_one_deadline_then_misses_at_once_and_puts_go_around_it(
    cluster_factory: ClusterFactory, flavour: str
) -> None:
    # SIGSTOP one of two nodes (for less than the node timeout: the index still names it). A
    # block held only there: the first read waits out its deadline, and the node is held back
    # (node_retry_ms): later reads of it miss at once instead of each waiting a deadline, and
    # new puts go to the other node. Once it is back, the next probe ends the hold. Over tcp:
    # over shared memory the node's directory answers reads for a second (test_directory).
    cluster = cluster_factory(masters=1, nodes=2, cpu_cache_size="64MiB", node_timeout_s=6.0)
    victim = cluster.node_names[0]
    keys = [f"stopped/{i}" for i in range(16)]
    settings: dict[str, Any] = {"timeout_s": 0.8, "transport": "tcp", "node_retry_ms": 500}

    def scenario(kv: Any) -> None:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        held = [loc.key for loc in kv.locate(keys) if loc.replicas[0].node_id == victim]
        assert held, "no key was placed on the node to stop"
        cluster.pause(victim)
        try:
            started = time.monotonic()
            assert kv.get(held[0]) is None
            assert time.monotonic() - started > 0.5  # the first read finds out
            worst = 0.0
            for k in held * 3:
                started = time.monotonic()
                assert kv.get(k) is None
                worst = max(worst, time.monotonic() - started)
            assert worst < 0.2, f"a read of a held node waited {worst:.3f} s"
            fresh = [f"stopped/new/{i}" for i in range(8)]
            started = time.monotonic()
            assert all(kv.put(k, _value(k)) for k in fresh)  # every one placed elsewhere
            assert time.monotonic() - started < 1.0
            assert {loc.replicas[0].node_id for loc in kv.locate(fresh)} != {victim}
        finally:
            cluster.resume(victim)
        time.sleep(0.6)  # node_retry_ms: the next read is the probe
        deadline = time.monotonic() + 5.0
        while kv.get(held[0]) != _value(held[0]):
            assert time.monotonic() < deadline, "the node was never read again"
        assert [kv.get(k) for k in held] == [_value(k) for k in held]

    if flavour == "Client":
        with Client(cluster.master_addresses, **settings) as kv:
            scenario(kv)
    else:
        asyncio.run(_in_async_client(cluster.master_addresses, settings, scenario))


async def _in_async_client(
    masters: list[str], settings: dict[str, Any], scenario: Callable[[Any], None]
) -> None:
    """Run ``scenario`` over a blocking facade of an AsyncClient, in a worker thread."""
    async with AsyncClient(masters, **settings) as kv:
        loop = asyncio.get_running_loop()

        class Blocking:
            def __getattr__(self, name: str) -> Callable[..., Any]:
                method = getattr(kv, name)
                return lambda *a, **k: asyncio.run_coroutine_threadsafe(
                    method(*a, **k), loop
                ).result()

        await asyncio.to_thread(scenario, Blocking())
