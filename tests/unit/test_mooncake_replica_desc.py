"""kvpool's Mooncake API answering ``batch_get_replica_desc`` from the index's locations: the
tier decides memory or disk; a failed lookup answers nothing, as Mooncake's does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockLocation
from kvpool.compat import mooncake as mc
from kvpool.errors import UnavailableError


class FakeClient:
    def __init__(self, where: dict[str, BlockLocation], down: bool = False) -> None:
        self.where = where
        self.down = down
        self.asked: list[list[str]] = []

    def locate(self, keys: Sequence[str]) -> list[BlockLocation | None]:
        self.asked.append(list(keys))
        if self.down:
            raise UnavailableError("no master answers")
        return [self.where.get(k) for k in keys]


def node(member_id: int) -> MemberInfo:
    return MemberInfo(member_id, f"node-{member_id}", f"tcp://10.0.0.{member_id}:7310", 1 << 30)


def location(key: str, tier: str, members: int) -> BlockLocation:
    return BlockLocation(key, 4096, 7, 99, tier, tuple(node(m) for m in range(1, members + 1)))


def store_on(client: FakeClient, monkeypatch: pytest.MonkeyPatch) -> mc.MooncakeDistributedStore:
    store = mc.MooncakeDistributedStore()
    monkeypatch.setattr(store, "_client", lambda config=None: client)
    return store


def test_a_block_on_the_ssd_tier_is_a_disk_replica_on_every_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = mc.namespace("default")
    client = FakeClient(
        {ns + "ssd": location(ns + "ssd", "ssd", 2), ns + "new": location(ns + "new", "", 1)}
    )
    store = store_on(client, monkeypatch)
    found = store.batch_get_replica_desc(["ssd", "new", "gone"])
    assert client.asked == [[ns + "ssd", ns + "new", ns + "gone"]]  # one lookup, namespaced
    assert sorted(found) == ["new", "ssd"]
    disk = found["ssd"]
    assert [d.is_disk_replica() for d in disk] == [True, True]
    assert not any(d.is_memory_replica() or d.is_local_disk_replica() for d in disk)
    assert disk[0].get_disk_descriptor().object_size == 4096
    assert disk[0].get_disk_descriptor().file_path == ""
    with pytest.raises(TypeError, match="no memory descriptor"):
        disk[0].get_memory_descriptor()
    (fresh,) = found["new"]
    assert fresh.is_memory_replica()
    assert fresh.get_memory_descriptor().buffer_descriptor.transport_endpoint == (
        "tcp://10.0.0.1:7310"
    )
    assert fresh.status is mc.ReplicaStatus.COMPLETE


def test_a_failed_lookup_answers_no_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_on(FakeClient({}, down=True), monkeypatch)
    assert store.batch_get_replica_desc(["a", "b"]) == {}
    assert store.get_replica_desc("a") == []
