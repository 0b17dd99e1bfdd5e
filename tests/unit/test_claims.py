"""ClaimReplicas: tier hints and warm-restart replicas in the index; the purge grace."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from kvpool.proto.v1 import common_pb2
from kvpool.raft_master.commands import (
    ClaimedBlock,
    ClaimReplicas,
    ClaimReplicasResult,
    CommitPuts,
    CommitPutsResult,
    DropReplicas,
    PutItem,
    RegisterMember,
    RegisterMemberResult,
    decode,
    decode_result,
    encode,
    encode_result,
)
from kvpool.raft_master.failure import FailureDetector, FailureLoop
from kvpool.raft_master.index import BlockIndex, pack_record
from kvpool.raft_master.records import record_replicas, record_tier, unpack_record, with_tier

SSD = int(common_pb2.TIER_SSD)
CPU = int(common_pb2.TIER_CPU)
_ids = itertools.count(1)


def rid() -> bytes:
    return next(_ids).to_bytes(16, "big")


def register(index: BlockIndex, node: str, incarnation: int = 1) -> int:
    result = index.apply(RegisterMember(rid(), node, incarnation, f"tcp://{node}:1", "", 100, ""))
    assert isinstance(result, RegisterMemberResult)
    return result.member_id


def put(index: BlockIndex, key: str, write_id: int, replicas: tuple[int, ...]) -> int:
    result = index.apply(
        CommitPuts(rid(), index.ring_version, (PutItem(key, write_id, 4, 77, replicas),))
    )
    assert isinstance(result, CommitPutsResult)
    return result.outcomes[0].version


def claim(
    index: BlockIndex, member: int, blocks: list[ClaimedBlock], *, restore: bool
) -> tuple[bool, ...]:
    result = index.apply(ClaimReplicas(rid(), member, restore, tuple(blocks)))
    assert isinstance(result, ClaimReplicasResult)
    index.check_invariants()
    return result.accepted


def test_a_restarted_node_gets_back_exactly_the_writes_it_still_holds() -> None:
    index = BlockIndex()
    old = register(index, "n", incarnation=1)
    versions = {k: put(index, k, 10 + i, (old,)) for i, k in enumerate("abcde")}
    new = register(index, "n", incarnation=2)  # the restart: the old member is down now
    assert index.lookup(["a"]) == [None]  # nothing names a dead member
    put(index, "d", 99, (new,))  # overwritten while the node was away
    blocks = [
        ClaimedBlock("a", 10, versions["a"], 4, 77, SSD),  # exact
        ClaimedBlock("b", 11, versions["b"], 4, 78, SSD),  # another checksum
        ClaimedBlock("c", 12, versions["c"] + 1, 4, 77, SSD),  # another version
        ClaimedBlock("d", 13, versions["d"], 4, 77, SSD),  # the index moved on
        ClaimedBlock("zzz", 1, 1, 4, 77, SSD),  # never indexed
        ClaimedBlock("e", 14, versions["e"], 4, 77, SSD),  # exact
    ]
    assert claim(index, new, blocks, restore=True) == (True, False, False, False, False, True)
    a, b, d = index.lookup(["a", "b", "d"])
    assert a is not None
    assert a.replicas == (new,)
    assert a.tier == SSD
    assert b is None
    assert d is not None
    assert d.write_id == 99
    # Claiming again is idempotent; without restore nothing is added.
    assert claim(index, new, blocks[:1], restore=True) == (True,)
    other = register(index, "m")
    assert claim(index, other, blocks[:1], restore=False) == (False,)
    assert index.lookup(["a"])[0].replicas == (new,)  # type: ignore[union-attr]


def test_tier_hints_follow_the_last_report_and_survive_other_changes() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    version = put(index, "k", 5, (a, b))
    (view,) = index.lookup(["k"])
    assert view is not None
    assert view.tier == 0
    revision = index.revision
    assert claim(index, a, [ClaimedBlock("k", 5, version, 4, 77, SSD)], restore=False) == (True,)
    assert index.lookup(["k"])[0].tier == SSD  # type: ignore[union-attr]
    assert index.revision == revision + 1
    assert claim(index, a, [ClaimedBlock("k", 5, version, 4, 77, SSD)], restore=False) == (True,)
    assert index.revision == revision + 1  # nothing changed: no new revision
    index.apply(DropReplicas(rid(), b, (("k", 5),)))
    (view,) = index.lookup(["k"])
    assert view is not None
    assert view.replicas == (a,)
    assert view.tier == SSD
    assert claim(index, a, [ClaimedBlock("k", 5, version, 4, 77, CPU)], restore=False) == (True,)
    assert index.lookup(["k"])[0].tier == CPU  # type: ignore[union-attr]


def test_a_dead_member_claims_nothing() -> None:
    index = BlockIndex()
    old = register(index, "n", incarnation=1)
    version = put(index, "k", 5, (old,))
    register(index, "n", incarnation=2)
    assert claim(index, old, [ClaimedBlock("k", 5, version, 4, 77, SSD)], restore=True) == (False,)


def test_records_with_a_tier_byte_read_the_same_without_it() -> None:
    for replicas in [(1,), (1, 2), (1, 2, 3), (7, 8, 9, 10), ()]:
        plain = pack_record(3, 4, 5, 6, replicas, pinned=True)
        hinted = with_tier(plain, SSD)
        assert record_replicas(hinted) == replicas
        assert unpack_record(hinted) == unpack_record(plain)
        assert record_tier(hinted) == SSD
        assert record_tier(plain) == 0
        assert with_tier(hinted, 0) == plain
        assert with_tier(hinted, CPU) == pack_record(3, 4, 5, 6, replicas, pinned=True, tier=CPU)


def test_claims_round_trip_through_the_log_encoding_and_the_dedupe_table() -> None:
    command = ClaimReplicas(
        rid(), 3, True, tuple(ClaimedBlock(f"k{i}", i + 1, i, 9, 7, SSD) for i in range(11))
    )
    assert decode(encode(command)) == command
    result = ClaimReplicasResult(tuple(i % 3 == 0 for i in range(11)), 42)
    assert decode_result(encode_result(result)) == result
    index = BlockIndex()
    member = register(index, "n")
    version = put(index, "k1", 1, (member,))
    again = ClaimReplicas(rid(), member, False, (ClaimedBlock("k1", 1, version, 4, 77, SSD),))
    first = index.apply(again)
    revision = index.revision
    assert index.apply(again) == first  # a retried request applies once
    assert index.revision == revision


class FakeReplicator:
    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    def is_leader(self) -> bool:
        return True

    def leads(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return True

    def term(self) -> int:
        return 1

    def read(self, fn: Any) -> Any:
        return fn(self.index)

    async def propose(self, command: Any, timeout_s: float) -> Any:
        return self.index.apply(command)


def test_a_dead_members_entries_wait_out_the_grace_so_a_restart_can_claim_them() -> None:
    index = BlockIndex()
    old = register(index, "n", incarnation=1)
    version = put(index, "k", 5, (old,))
    put(index, "lost", 6, (old,))
    now = [0.0]
    loop = FailureLoop(
        FakeReplicator(index),  # type: ignore[arg-type]
        FailureDetector(1000.0),
        commit_timeout_s=1.0,
        clock=lambda: now[0],
        restore_grace_s=30.0,
    )

    async def run() -> None:
        await loop.step()
        new = register(index, "n", incarnation=2)  # restart: old member down now
        now[0] = 1.0
        await loop.step()
        now[0] = 20.0
        await loop.step()
        assert len(index) == 2  # within the grace: kept (lookups already ignore it)
        assert claim(index, new, [ClaimedBlock("k", 5, version, 4, 77, SSD)], restore=True) == (
            True,
        )
        now[0] = 31.5
        await loop.step()
        assert index.lookup(["lost"]) == [None]
        assert len(index) == 1  # "lost" was not claimed: purged after the grace
        (k,) = index.lookup(["k"])
        assert k is not None
        assert k.replicas == (new,)
        index.check_invariants()

    asyncio.run(run())
