"""The read flow (:func:`kvpool.client.ops.read_flow`) driven step by step: no socket, no
thread, no event loop. The test is the driver: it answers each Lookup from a dict standing for
the index and each Read from a set standing for what the nodes hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import pytest

from kvpool.client.cache import LookupCache
from kvpool.client.ops import EnsureMembers, Lookup, Read, ReadFlow, ReadStep, drive, read_flow
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.plans import SHM_GET_BATCH, NodeRead, ReadItem
from kvpool.errors import BlockMissError
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import Op, TierLevel
from kvpool.transports.shm import Arena

DEADLINE = 10.0
NODE = MemberInfo(member_id=1, node_id="n1", data_address="tcp://n1:1", capacity_bytes=1 << 30)


def entry(
    key: str, write_id: int, tier: common_pb2.Tier.ValueType = common_pb2.TIER_UNKNOWN
) -> common_pb2.BlockEntry:
    return common_pb2.BlockEntry(
        key=key,
        found=True,
        version=write_id,
        write_id=write_id,
        size_bytes=4,
        replicas=[1],
        tier=tier,
    )


@dataclass
class World:
    """The index (key → entry), the nodes (the (key, write id) pairs they hold), the clock."""

    index: dict[str, common_pb2.BlockEntry] = field(default_factory=dict)
    held: set[tuple[str, int]] = field(default_factory=set)
    now: float = 0.0
    after_read: float | None = None  # the clock once a Read is done
    steps: list[tuple[str, list[str]]] = field(default_factory=list)
    sinks: list[tuple[int, str]] = field(default_factory=list)
    cache: LookupCache = field(default_factory=lambda: LookupCache(64, 60.0, clock=lambda: 0.0))
    placement: Placement = field(default_factory=Placement)
    direct: Callable[[str], bool] | None = None  # keys read by content (direct_reads)
    committed: dict[str, int] = field(default_factory=dict)  # what a read by content finds
    members: list[MemberInfo] = field(default_factory=list)  # what GetMembers answers
    direct_counts: list[tuple[int, int]] = field(default_factory=list)  # on_direct's reports

    def cached(self, *entries: common_pb2.BlockEntry) -> None:
        self.cache.store_many([e.key for e in entries], list(entries), revision=1)

    def sink_for(self, index: int, key: str, size: int) -> tuple[memoryview | None, bool]:
        self.sinks.append((index, key))
        return None, False

    def flow(self, keys: list[str], *, limit: int = 0) -> ReadFlow:
        pairs = [(k, k.encode()) for k in keys]
        return read_flow(
            self.cache,
            self.placement,
            pairs,
            self.sink_for,
            limit=limit,
            deadline=DEADLINE,
            clock=lambda: self.now,
            direct=self.direct,
            on_direct=lambda hits, misses: self.direct_counts.append((hits, misses)),
        )

    def run(self, keys: list[str], *, limit: int = 0) -> list[ReadItem | None]:
        items = drive(self.flow(keys, limit=limit), self.perform)
        self.check(keys, items)
        return items

    def perform(self, step: ReadStep) -> master_pb2.LookupResponse | None:
        if isinstance(step, Lookup):
            self.steps.append(("lookup", list(step.keys)))
            return self.lookup(step.keys)
        if isinstance(step, EnsureMembers):
            assert not step.patient, "a read asks for the membership once"
            self.steps.append(("members", []))
            if self.members:
                self.placement.update(self.members, 1, self.now)
            else:
                self.placement.refresh_tried(self.now)  # no master answered
            return None
        self.steps.append(("read", [it.key for it in step.items]))
        self.read(step.items)
        return None

    def lookup(self, keys: list[str]) -> master_pb2.LookupResponse:
        entries = [self.index.get(k) or common_pb2.BlockEntry(key=k, found=False) for k in keys]
        return master_pb2.LookupResponse(
            entries=entries,
            members=[common_pb2.Member(member_id=1, node_id="n1", data_address="tcp://n1:1")],
            revision=2,
        )

    def read(self, items: list[ReadItem]) -> None:
        for it in items:
            assert it.replicas, "a Read names only items with a replica to read"
            if not it.entry.write_id:  # read by content: the node's committed write, if any
                assert it.replicas == [NODE.member_id], "read from the ring's primary"
                if it.key in self.committed:
                    it.entry.write_id = self.committed[it.key]
                    it.ok = True
                    it.value = b"data"
                else:
                    it.fail("absent", BlockMissError("not held", reason="absent"))
            elif (it.key, it.entry.write_id) in self.held:
                it.ok = True
                it.value = b"data"
            else:
                it.fail("version_mismatch", BlockMissError("not held", reason="version_mismatch"))
        if self.after_read is not None:
            self.now = self.after_read

    def check(self, keys: list[str], items: list[ReadItem | None]) -> None:
        """Invariants of every read: one answer per key, in order; a failed item's cached
        entry (for the write id that failed) is gone."""
        assert len(items) == len(keys)
        for key, it in zip(keys, items, strict=True):
            if it is None:
                continue
            assert it.key == key
            if not it.ok:
                cached = self.cache.get(key)
                assert cached is None or cached.write_id != it.entry.write_id


def test_all_cached_and_hit_needs_no_lookup() -> None:
    w = World(held={("a", 1), ("b", 1)})
    w.cached(entry("a", 1), entry("b", 1))
    items = w.run(["a", "b"])
    assert w.steps == [("read", ["a", "b"])]
    assert all(it is not None and it.ok and it.from_cache for it in items)
    cached = w.cache.get("a")
    assert cached is not None
    assert cached.write_id == 1


def test_uncached_keys_are_looked_up_once_then_read() -> None:
    w = World(index={"a": entry("a", 1)}, held={("a", 1)})
    items = w.run(["a"])
    assert w.steps == [("lookup", ["a"]), ("read", ["a"])]
    item = items[0]
    assert item is not None
    assert item.ok
    assert not item.from_cache


def test_stale_cached_entry_gets_exactly_one_more_lookup_and_read() -> None:
    w = World(index={"a": entry("a", 2)}, held={("a", 2)})
    w.cached(entry("a", 1))  # the key was written again since
    items = w.run(["a"])
    assert w.steps == [("read", ["a"]), ("lookup", ["a"]), ("read", ["a"])]
    item = items[0]
    assert item is not None
    assert item.ok
    assert item.entry.write_id == 2
    assert not item.from_cache
    assert w.cache.get("a") is None  # the stale entry is gone (the driver caches the new one)


def test_a_fresh_entry_that_misses_again_is_not_looked_up_a_third_time() -> None:
    w = World(index={"a": entry("a", 2)})  # no node holds it any more
    w.cached(entry("a", 1))
    items = w.run(["a"])
    assert w.steps == [("read", ["a"]), ("lookup", ["a"]), ("read", ["a"])]
    item = items[0]
    assert item is not None
    assert not item.ok
    assert item.reason == "version_mismatch"


def test_a_key_the_index_lacks_is_none_and_not_read() -> None:
    w = World()
    items = w.run(["gone"])
    assert items == [None]
    assert w.steps == [("lookup", ["gone"])]
    assert w.sinks == []


def test_past_the_deadline_a_stale_entry_gets_no_second_lookup() -> None:
    w = World(index={"a": entry("a", 2)}, held={("a", 2)}, after_read=DEADLINE)
    w.cached(entry("a", 1))
    items = w.run(["a"])
    assert w.steps == [("read", ["a"])]
    item = items[0]
    assert item is not None
    assert not item.ok
    assert item.from_cache
    assert w.cache.get("a") is None  # dropped: it names the write id that missed


def test_just_before_the_deadline_a_stale_entry_is_looked_up_again() -> None:
    w = World(index={"a": entry("a", 2)}, held={("a", 2)}, after_read=DEADLINE - 1e-6)
    w.cached(entry("a", 1))
    items = w.run(["a"])
    assert [kind for kind, _ in w.steps] == ["read", "lookup", "read"]
    assert items[0] is not None
    assert items[0].ok


def test_partial_batch_some_hit_some_miss() -> None:
    w = World(
        index={"a": entry("a", 1), "b": entry("b", 2), "c": entry("c", 1), "e": entry("e", 1)},
        held={("a", 1), ("b", 2), ("c", 1)},
    )
    w.cached(entry("a", 1), entry("b", 1), entry("e", 1))
    items = w.run(["a", "b", "c", "d", "e"])
    # c and d are looked up together; a, b and e are read through the cache, with c; the
    # two cached entries that missed (b stale, e held nowhere) are looked up again at once.
    assert w.steps == [
        ("lookup", ["c", "d"]),
        ("read", ["a", "b", "c", "e"]),
        ("lookup", ["b", "e"]),
        ("read", ["b", "e"]),
    ]
    a, b, c, d, e = items
    assert a is not None
    assert a.ok
    assert a.from_cache
    assert b is not None
    assert b.ok
    assert b.entry.write_id == 2
    assert not b.from_cache
    assert c is not None
    assert c.ok
    assert d is None
    assert e is not None
    assert not e.ok
    assert not e.from_cache
    # A re-read key's bytes go to its place in the caller's batch.
    assert w.sinks == [(0, "a"), (1, "b"), (2, "c"), (4, "e"), (1, "b"), (4, "e")]


def test_a_block_only_on_a_slower_tier_is_a_miss_without_a_read() -> None:
    w = World(index={"a": entry("a", 1, tier=common_pb2.TIER_SSD)}, held={("a", 1)})
    items = w.run(["a"], limit=TierLevel.CPU)
    assert w.steps == [("lookup", ["a"])]
    item = items[0]
    assert item is not None
    assert not item.ok
    assert item.reason == "slow_tier"


def test_only_the_failed_write_id_is_dropped_from_the_cache() -> None:
    w = World(index={"a": entry("a", 2)}, after_read=DEADLINE)
    w.cached(entry("a", 1))
    flow = w.flow(["a"])
    step = next(flow)
    assert isinstance(step, Read)
    w.read(step.items)
    w.cached(entry("a", 3))  # a newer write learnt meanwhile (another call's lookup)
    with pytest.raises(StopIteration) as done:  # past its deadline: no more steps
        flow.send(None)
    item = done.value.value[0]
    assert item is not None
    assert not item.ok
    cached = w.cache.get("a")
    assert cached is not None
    assert cached.write_id == 3


def test_no_keys_no_steps() -> None:
    w = World()
    assert w.run([]) == []
    assert w.steps == []


# --- reads by content (direct_reads): no Lookup first ---------------------------------------------


def by_content(key: str) -> bool:
    return key.startswith("kv1/")


def direct_world(**kwargs: object) -> World:
    w = World(direct=by_content, members=[NODE], **kwargs)  # type: ignore[arg-type]
    w.placement.update([NODE], 1, 0.0)
    return w


def test_a_key_naming_its_content_is_read_from_its_node_with_no_lookup() -> None:
    w = direct_world(committed={"kv1/a": 7})
    items = w.run(["kv1/a"])
    assert w.steps == [("read", ["kv1/a"])]
    it = items[0]
    assert it is not None
    assert it.ok
    assert it.entry.write_id == 7, "the hit names the write the node served"
    assert w.sinks == [(0, "kv1/a")]


def test_a_read_by_content_that_misses_is_looked_up_and_read_through_the_index() -> None:
    w = direct_world(index={"kv1/a": entry("kv1/a", 3)}, held={("kv1/a", 3)})
    items = w.run(["kv1/a"])
    assert w.steps == [("read", ["kv1/a"]), ("lookup", ["kv1/a"]), ("read", ["kv1/a"])]
    assert w.direct_counts == [(0, 1)]
    it = items[0]
    assert it is not None
    assert it.ok
    assert it.entry.write_id == 3


def test_a_read_by_content_of_a_key_nowhere_is_none_after_one_lookup() -> None:
    w = direct_world()
    assert w.run(["kv1/a"]) == [None]
    assert w.steps == [("read", ["kv1/a"]), ("lookup", ["kv1/a"])]


def test_only_the_keys_not_naming_their_content_are_looked_up_first() -> None:
    w = direct_world(
        index={"b": entry("b", 1)}, held={("b", 1)}, committed={"kv1/a": 2, "kv1/c": 4}
    )
    items = w.run(["kv1/a", "b", "kv1/c"])
    assert w.steps == [("lookup", ["b"]), ("read", ["kv1/a", "b", "kv1/c"])]
    assert [it is not None and it.ok for it in items] == [True, True, True]
    assert w.direct_counts == [(2, 0)]


def test_a_cached_entry_wins_over_a_read_by_content() -> None:
    w = direct_world(held={("kv1/a", 5)}, committed={"kv1/a": 9})
    w.cached(entry("kv1/a", 5))
    items = w.run(["kv1/a"])
    assert w.steps == [("read", ["kv1/a"])]
    assert items[0] is not None
    assert items[0].entry.write_id == 5


def test_with_no_ring_yet_the_membership_is_asked_for_once_then_read_by_content() -> None:
    w = World(direct=by_content, members=[NODE], committed={"kv1/a": 7})
    items = w.run(["kv1/a"])
    assert w.steps == [("members", []), ("read", ["kv1/a"])]
    assert items[0] is not None
    assert items[0].ok
    w.steps.clear()
    w.run(["kv1/a"])
    assert w.steps == [("read", ["kv1/a"])], "the ring is kept"


def test_when_no_membership_can_be_had_the_read_goes_through_the_index() -> None:
    w = World(direct=by_content, index={"kv1/a": entry("kv1/a", 1)}, held={("kv1/a", 1)})
    items = w.run(["kv1/a"])
    assert w.steps == [("members", []), ("lookup", ["kv1/a"]), ("read", ["kv1/a"])]
    assert items[0] is not None
    assert items[0].ok
    w.steps.clear()
    w.run(["kv1/a"])
    assert w.steps == [("lookup", ["kv1/a"]), ("read", ["kv1/a"])], "no second ask at once"
    w.now = 1.0
    w.steps.clear()
    w.run(["kv1/a"])
    assert w.steps[0] == ("members", []), "asked again after min_refresh_interval_s"


def test_direct_reads_off_looks_every_key_up() -> None:
    w = direct_world(committed={"kv1/a": 7})
    w.direct = None
    w.index["kv1/a"] = entry("kv1/a", 7)
    w.held.add(("kv1/a", 7))
    w.run(["kv1/a"])
    assert w.steps == [("lookup", ["kv1/a"]), ("read", ["kv1/a"])]


def test_a_read_by_content_tries_the_rings_first_members_primary_first() -> None:
    other = MemberInfo(member_id=2, node_id="n2", data_address="tcp://n2:1", capacity_bytes=1 << 30)
    placement = Placement()
    placement.update([NODE, other], 1, 0.0)
    pairs = [("kv1/a", b"kv1/a")]
    flow = read_flow(
        LookupCache(64, 60.0, clock=lambda: 0.0),
        placement,
        pairs,
        lambda _i, _k, _s: (None, False),
        limit=0,
        deadline=DEADLINE,
        clock=lambda: 0.0,
        direct=by_content,
        direct_replicas=2,
    )
    step = next(flow)
    assert isinstance(step, Read)
    (it,) = step.items
    assert it.entry.write_id == 0
    assert it.replicas == [m.member_id for m in placement.place(b"kv1/a", 2)]
    assert sorted(it.replicas) == [1, 2]


def test_a_read_asks_its_node_for_exactly_the_size_the_index_names() -> None:
    """The frames of a read carry the size the index named for each block (a read by content,
    whose size is not known yet, carries none): the connection refuses an answer of another
    size before allocating anything for it."""

    def item(key: str, write_id: int, size: int) -> ReadItem:
        e = common_pb2.BlockEntry(key=key, found=True, write_id=write_id, size_bytes=size)
        return ReadItem(key, key.encode(), e, sink=None, caller_buffer=False, replicas=[1])

    one = NodeRead("tcp://n1:1", [item("a", 7, 4096)], mget=True, arena=None)
    assert [c.expect for c in one.calls] == [4096]
    direct = NodeRead("tcp://n1:1", [item("b", 0, 0)], mget=True, arena=None)
    assert [c.expect for c in direct.calls] == [-1]
    batch = NodeRead(
        "tcp://n1:1", [item("a", 7, 4096), item("b", 0, 0), item("c", 8, 9)], mget=True, arena=None
    )
    assert [c.expects for c in batch.calls] == [[4096, -1, 9]]


def test_over_shared_memory_a_batch_leases_every_block_and_a_lone_small_one_comes_inline() -> None:
    """A batch of SHM_GET_BATCH keys or more: one SHM_GET for all, small blocks too (an MGET's
    inline bytes would squeeze through the unix socket's small buffer); fewer keys: blocks
    under SHM_GET_MIN_BYTES come inline (one round trip), larger ones are leased."""

    def item(key: str, size: int) -> ReadItem:
        e = common_pb2.BlockEntry(key=key, found=True, write_id=7, size_bytes=size)
        return ReadItem(key, key.encode(), e, sink=None, caller_buffer=False, replicas=[1])

    arena = cast(Arena, object())  # only its presence matters to the plan
    small = [item(f"s{i}", 4096) for i in range(SHM_GET_BATCH)]
    batch = NodeRead("shm://n1", small, mget=True, arena=arena)
    assert [Op(c.op) for c in batch.calls] == [Op.SHM_GET]
    few = NodeRead("shm://n1", [small[0], small[1], item("big", 1 << 20)], mget=True, arena=arena)
    assert sorted(Op(c.op).name for c in few.calls) == ["MGET", "SHM_GET"]
    assert NodeRead("shm://n1", small, mget=True, arena=None).calls[0].op == Op.MGET  # tcp
