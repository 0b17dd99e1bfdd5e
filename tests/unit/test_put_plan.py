"""NodeStage: the PUT frames of a batch to one node, made a group at a time, each block hashed
only when its group is about to be sent."""

from __future__ import annotations

from kvpool.checksum import block_checksum
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import NodeStage, PutItem
from kvpool.proto.wire import Op

NODE = MemberInfo(member_id=1, node_id="n1", data_address="tcp://127.0.0.1:1", capacity_bytes=1)


def items(n: int, size: int) -> list[PutItem]:
    out = []
    for i in range(n):
        key = f"k{i}"
        it = PutItem(key, key.encode(), memoryview(bytes([i]) * size))
        it.restart(100 + i, [NODE])
        out.append(it)
    return out


def test_groups_are_made_in_order_and_hashed_only_when_asked_for() -> None:
    batch = items(10, 1 << 20)
    plan = NodeStage("tcp://127.0.0.1:1", [(it, NODE) for it in batch], arena=None)
    assert plan.calls == []
    groups = plan.chunks(chunk_bytes=4 << 20)
    first = next(groups)
    assert [c.key for c in first] == [f"k{i}".encode() for i in range(4)]
    assert all(it._checksum is None for it in batch[4:])  # not hashed before their turn
    rest = list(groups)
    assert [len(g) for g in rest] == [4, 2]
    sent = [c for g in [first, *rest] for c in g]
    assert plan.calls == sent
    for call, it in zip(sent, batch, strict=True):
        assert call.op == Op.PUT
        assert call.write_id == it.write_id
        assert call.checksum == block_checksum(it.payload) == it.checksum


def test_all_calls_makes_every_frame_at_once() -> None:
    batch = items(3, 100)
    plan = NodeStage("tcp://127.0.0.1:1", [(it, NODE) for it in batch], arena=None)
    calls = plan.all_calls()
    assert [c.key for c in calls] == [b"k0", b"k1", b"k2"]
    assert plan.calls == calls
    assert all(it._checksum is not None for it in batch)
