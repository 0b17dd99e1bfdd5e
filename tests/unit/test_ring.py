"""Properties of the consistent-hash ring (proto/ring.py) every client relies on: the same members
give the same placement anywhere, replicas are distinct, and a join or a leave moves only the keys
of the member that joined or left."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.proto.ring import (
    BYTES_PER_VNODE,
    MAX_VNODES,
    MIN_VNODES,
    HashRing,
    RingMember,
    key_hash,
    vnodes_for,
)

GiB = 2**30

node_ids = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12
)
capacities = st.sampled_from([0, 1 * GiB, 2 * GiB, 4 * GiB, 64 * 2**20, 10 * GiB])
keys = st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=40, unique=True)


@st.composite
def member_sets(draw: st.DrawFn, min_size: int = 1, max_size: int = 8) -> list[RingMember]:
    ids = draw(st.lists(node_ids, min_size=min_size, max_size=max_size, unique=True))
    return [
        RingMember(member_id=i + 1, node_id=nid, capacity_bytes=draw(capacities))
        for i, nid in enumerate(ids)
    ]


@settings(max_examples=100, deadline=None)
@given(members=member_sets(), keys=keys, n=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_placement_is_deterministic_and_order_free(
    members: list[RingMember], keys: list[str], n: int, seed: int
) -> None:
    shuffled = members[:]
    random.Random(seed).shuffle(shuffled)
    a, b = HashRing(members, version=3), HashRing(shuffled, version=3)
    for key in keys:
        assert a.place(key, n) == b.place(key, n)
        assert a.place(key, n) == a.place(key.encode("utf-8"), n)  # str and its UTF-8 agree


def test_placement_is_pinned_across_processes() -> None:
    # mmh3 values, not Python's hash(): every client on every machine and release must place
    # a key the same way, so these numbers are part of the wire contract.
    assert key_hash("kvpool") == key_hash(b"kvpool") == 15490573494256031315
    assert key_hash("block/0") == 16460133435941657877
    ring = HashRing(
        [RingMember(1, "node-a", GiB), RingMember(2, "node-b", GiB), RingMember(3, "node-c", GiB)]
    )
    placed = [ring.place(f"block/{i}", 2) for i in range(6)]
    assert placed == [[2, 1], [2, 3], [2, 1], [1, 3], [2, 1], [3, 1]]
    assert [ring.place(f"block/{i}") for i in range(6)] == [[p[0]] for p in placed]
    # Every member owns some of a thousand keys (vnodes spread them).
    owners = {ring.place(f"k{i}")[0] for i in range(1000)}
    assert owners == {1, 2, 3}


@settings(max_examples=100, deadline=None)
@given(
    members=member_sets(),
    keys=keys,
    n=st.integers(2, 6),
    zones=st.lists(st.sampled_from(["", "a", "b", "c"]), min_size=8, max_size=8),
)
def test_one_replica_is_the_primary_of_any_placement(
    members: list[RingMember], keys: list[str], n: int, zones: list[str]
) -> None:
    """A key's one replica (a read by content goes there) is the first of its placement at any
    replica count, zones or none: readers and writers of different counts agree on it."""
    zoned = [
        RingMember(m.member_id, m.node_id, m.capacity_bytes, zone)
        for m, zone in zip(members, zones, strict=False)
    ]
    for ring in (HashRing(members), HashRing(zoned)):
        for key in keys:
            assert ring.place(key, 1) == ring.place(key, n)[:1]


@settings(max_examples=100, deadline=None)
@given(members=member_sets(), keys=keys, n=st.integers(1, 10))
def test_replicas_are_distinct_members(members: list[RingMember], keys: list[str], n: int) -> None:
    ring = HashRing(members)
    ids = {m.member_id for m in members}
    for key in keys:
        placed = ring.place(key, n)
        assert len(placed) == min(n, len(members))
        assert len(set(placed)) == len(placed)
        assert set(placed) <= ids


def test_empty_ring_and_zero_replicas_place_nothing() -> None:
    assert HashRing([]).place("k", 3) == []
    assert HashRing([RingMember(1, "a", GiB)]).place("k", 0) == []


@settings(max_examples=100, deadline=None)
@given(
    members=member_sets(min_size=1, max_size=6),
    newcomer=node_ids,
    capacity=capacities,
    keys=keys,
    n=st.integers(1, 4),
)
def test_a_join_moves_only_keys_to_the_newcomer(
    members: list[RingMember], newcomer: str, capacity: int, keys: list[str], n: int
) -> None:
    if newcomer in {m.node_id for m in members}:
        newcomer += "-new"
    new = RingMember(member_id=100, node_id=newcomer, capacity_bytes=capacity)
    before = HashRing(members, version=1)
    after = HashRing([*members, new], version=2)
    for key in keys:
        old, now = before.place(key, n), after.place(key, n)
        if n == 1:
            assert now == old or now == [100]
        # The newcomer slots in; everyone else keeps their rank, the last may drop out.
        others = [m for m in now if m != 100]
        assert others == old[: len(others)]
        if 100 not in now:
            assert now == old


@settings(max_examples=100, deadline=None)
@given(members=member_sets(min_size=2, max_size=7), keys=keys, n=st.integers(1, 4), data=st.data())
def test_a_leave_moves_only_the_leavers_keys(
    members: list[RingMember], keys: list[str], n: int, data: st.DataObject
) -> None:
    leaver = data.draw(st.sampled_from(members))
    before = HashRing(members, version=1)
    after = HashRing([m for m in members if m is not leaver], version=2)
    for key in keys:
        old, now = before.place(key, n), after.place(key, n)
        if leaver.member_id not in old:
            assert now == old
        else:
            survivors = [m for m in old if m != leaver.member_id]
            assert now[: len(survivors)] == survivors
            assert leaver.member_id not in now


def test_zones_are_spread_before_one_is_reused() -> None:
    members = [
        RingMember(1, "a1", GiB, zone="a"),
        RingMember(2, "a2", GiB, zone="a"),
        RingMember(3, "b1", GiB, zone="b"),
        RingMember(4, "b2", GiB, zone="b"),
        RingMember(5, "c1", GiB, zone="c"),
    ]
    ring = HashRing(members)
    zone_of = {m.member_id: m.zone for m in members}
    for i in range(300):
        placed = ring.place(f"k{i}", 3)
        assert len({zone_of[m] for m in placed}) == 3
        five = ring.place(f"k{i}", 5)
        assert sorted(five) == [1, 2, 3, 4, 5]
        assert len({zone_of[m] for m in five[:3]}) == 3


def test_capacity_weights_the_share_of_keys() -> None:
    assert vnodes_for(0) == MIN_VNODES
    assert vnodes_for(10**15) == MAX_VNODES
    assert vnodes_for(100 * BYTES_PER_VNODE) == 100
    ring = HashRing([RingMember(1, "small", 1 * GiB), RingMember(2, "big", 8 * GiB)])
    owners = [ring.place(f"block/{i}")[0] for i in range(20000)]
    share_big = owners.count(2) / len(owners)
    assert 0.8 < share_big < 0.97  # 8/9 ≈ 0.89 of the points


def test_a_member_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        HashRing([RingMember(1, "a", GiB), RingMember(1, "b", GiB)])


@settings(max_examples=40, deadline=None)
@given(members=member_sets(min_size=2, max_size=6), keys=keys, data=st.data())
def test_a_restarted_node_gets_its_keys_back(
    members: list[RingMember], keys: list[str], data: st.DataObject
) -> None:
    # A node that re-registers gets a new member id but keeps its node id, hence its points.
    again = data.draw(st.sampled_from(members))
    reborn = RingMember(999, again.node_id, again.capacity_bytes, again.zone)
    before = HashRing(members)
    after = HashRing([reborn if m is again else m for m in members])
    rename = {again.member_id: 999}
    for key in keys:
        assert after.place(key, 2) == [rename.get(m, m) for m in before.place(key, 2)]
