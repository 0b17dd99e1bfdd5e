"""What a put does after its commit (client/commits.py ``superseded``): the replaced write's
blocks are deleted wherever the index had them, and the PUBLISH is waited for where the new
write goes too."""

from __future__ import annotations

from kvpool.client.commits import superseded
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import PutItem
from kvpool.proto.v1 import master_pb2


def member(member_id: int) -> MemberInfo:
    return MemberInfo(member_id, f"node-{member_id}", f"tcp://127.0.0.1:{member_id}", 1 << 30)


def item(key: str, committed: bool = True) -> PutItem:
    it = PutItem(key, key.encode(), memoryview(b"v"), 0)
    it.committed = committed
    return it


def result(
    replicas: list[int], old: int = 0, old_on: list[int] | None = None
) -> master_pb2.PutResult:
    return master_pb2.PutResult(
        status=master_pb2.PUT_STATUS_COMMITTED,
        version=9,
        replicas=replicas,
        superseded_write_id=old,
        superseded_replicas=old_on or [],
    )


def test_a_fresh_key_needs_nothing_more() -> None:
    deletes, wait = superseded([item("a")], [result([1])], member)
    assert (deletes, wait) == ([], False)


def test_replaced_blocks_are_deleted_and_a_replaced_block_here_is_waited_for() -> None:
    deletes, wait = superseded([item("a")], [result([1], old=77, old_on=[1, 2, 3])], member)
    assert wait  # member 1 gets the new block: its PUBLISH drops the old one there
    # ... and the DELETE too (the PUBLISH may find the new write already removed)
    assert [(d.key_bytes, d.write_id, d.member.member_id) for d in deletes] == [
        (b"a", 77, 1),
        (b"a", 77, 2),
        (b"a", 77, 3),
    ]


def test_unknown_members_and_uncommitted_items_are_skipped() -> None:
    known = {1: member(1)}
    deletes, wait = superseded(
        [item("a"), item("b", committed=False)],
        [result([1], old=5, old_on=[4]), result([1], old=6, old_on=[2])],
        known.get,
    )
    assert (deletes, wait) == ([], False)
