"""Replicated commands: their durable encoding, stored results, and the group committer."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import MalformedRequestError, UnavailableError
from kvpool.proto.v1 import master_pb2, raft_pb2
from kvpool.raft_master.commands import (
    FORMAT_VERSION,
    PUT_COMMITTED,
    PUT_NO_LIVE_REPLICA,
    Batch,
    BatchResult,
    CommandDecodeError,
    CommitPuts,
    CommitPutsResult,
    DropReplicas,
    DropReplicasResult,
    ErrorResult,
    MarkMemberDown,
    MarkMemberDownResult,
    PutItem,
    PutOutcome,
    RegisterMaster,
    RegisterMasterResult,
    RegisterMember,
    RegisterMemberResult,
    RemovedBlock,
    RemoveKeys,
    RemoveKeysResult,
    Result,
    SetDraining,
    SetDrainingResult,
    SimpleCommand,
    decode,
    decode_result,
    encode,
    encode_result,
)
from kvpool.raft_master.group_commit import GroupCommitter
from kvpool.raft_master.index import BlockIndex

u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
rid = st.binary(min_size=16, max_size=16)
text = st.text(max_size=20)
keys = st.text(min_size=1, max_size=30)

put_items = st.builds(
    PutItem,
    key=keys,
    write_id=u64,
    size_bytes=u64,
    checksum=u64,
    replicas=st.lists(u32, max_size=4).map(tuple),
)
simple_commands: st.SearchStrategy[SimpleCommand] = st.one_of(
    st.builds(CommitPuts, rid, u64, st.lists(put_items, max_size=5).map(tuple)),
    st.builds(RemoveKeys, rid, st.lists(keys, max_size=5).map(tuple)),
    st.builds(DropReplicas, rid, u32, st.lists(st.tuples(keys, u64), max_size=5).map(tuple)),
    st.builds(RegisterMember, rid, text, u64, text, text, u64, text),
    st.builds(MarkMemberDown, rid, u32, text),
    st.builds(RegisterMaster, rid, text, text),
    st.builds(SetDraining, rid, u32, st.booleans()),
)
commands = st.one_of(
    simple_commands,
    st.builds(Batch, rid, st.lists(simple_commands, max_size=4).map(tuple)),
)


# --- encoding ---------------------------------------------------------------------------------


@given(commands)
def test_every_command_round_trips_through_its_encoding(command: CommitPuts | Batch) -> None:
    data = encode(command)
    assert decode(data) == command
    assert encode(decode(data)) == data  # deterministic bytes


def test_encoding_is_the_versioned_raft_command_message() -> None:
    msg = raft_pb2.RaftCommand.FromString(encode(RemoveKeys(b"r" * 16, ("a", "b"))))
    assert msg.format_version == FORMAT_VERSION
    assert msg.request_id == b"r" * 16
    assert list(msg.remove_keys.keys) == ["a", "b"]


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff", b"\x0a\x05ab", bytes(range(40))],
    ids=["garbage", "truncated", "random"],
)
def test_undecodable_bytes_raise_a_typed_error(data: bytes) -> None:
    with pytest.raises(CommandDecodeError) as info:
        decode(data)
    assert isinstance(info.value, MalformedRequestError)


def test_an_unknown_format_version_is_refused_naming_both_versions() -> None:
    msg = raft_pb2.RaftCommand.FromString(encode(RemoveKeys(b"r" * 16, ("a",))))
    msg.format_version = 7
    with pytest.raises(CommandDecodeError, match=r"format version 7.*applies version 1"):
        decode(msg.SerializeToString())


def test_a_command_without_a_body_is_refused() -> None:
    empty = raft_pb2.RaftCommand(format_version=FORMAT_VERSION, request_id=b"x" * 16)
    with pytest.raises(CommandDecodeError, match="no body"):
        decode(empty.SerializeToString())


def test_a_batch_inside_a_batch_is_refused_both_ways() -> None:
    inner = raft_pb2.RaftCommand.FromString(encode(Batch(b"i" * 16, ())))
    outer = raft_pb2.RaftCommand(format_version=FORMAT_VERSION, request_id=b"o" * 16)
    outer.batch.commands.append(inner)
    with pytest.raises(CommandDecodeError, match="must not contain a Batch"):
        decode(outer.SerializeToString())
    with pytest.raises(ValueError, match="must not contain a Batch"):
        encode(Batch(b"o" * 16, (Batch(b"i" * 16, ()),)))  # type: ignore[arg-type]


def test_applying_an_undecodable_entry_changes_nothing() -> None:
    index = BlockIndex()
    index.apply(RegisterMember(b"a" * 16, "n1", 1, "tcp://h:1", "h:2", 10, ""))
    before = index.canonical_state()
    for data in (b"\xff\xfe", b"", encode(RemoveKeys(b"b" * 16, ("k",)))[:-1]):
        result = index.apply_encoded(data)
        assert isinstance(result, ErrorResult)
        assert index.canonical_state() == before


# --- stored results -----------------------------------------------------------------------------

stored_results: st.SearchStrategy[Result] = st.one_of(
    st.builds(
        CommitPutsResult,
        st.lists(
            st.builds(
                PutOutcome,
                st.sampled_from([PUT_COMMITTED, PUT_NO_LIVE_REPLICA]),
                u64,
                st.lists(u32, max_size=3).map(tuple),
                u64,
                st.lists(u32, max_size=3).map(tuple),
            ),
            max_size=4,
        ).map(tuple),
        u64,
        u64,
        st.booleans(),
    ),
    st.builds(
        RemoveKeysResult,
        st.lists(st.booleans(), max_size=4).map(tuple),
        st.lists(
            st.builds(RemovedBlock, keys, u64, st.lists(u32, max_size=3).map(tuple)), max_size=3
        ).map(tuple),
        u64,
        u64,
        st.booleans(),
    ),
    st.builds(DropReplicasResult, u32, u64),
    st.builds(RegisterMemberResult, u32, u64),
    st.builds(MarkMemberDownResult, st.booleans(), u64),
    st.builds(RegisterMasterResult, u64),
    st.builds(SetDrainingResult, st.booleans(), st.booleans(), u64),
)


@given(stored_results)
def test_stored_results_round_trip(result: Result) -> None:
    assert decode_result(encode_result(result)) == result


def test_large_results_are_stored_packed_and_what_does_not_fit_as_protobuf() -> None:
    outcomes = tuple(PutOutcome(PUT_COMMITTED, 10**12 + i, (3, 4), i, (5,)) for i in range(256))
    result = CommitPutsResult(outcomes, 77, 5)
    stored = encode_result(result)
    assert stored[0] == 11  # the packed form: fixed-width columns, not protobuf
    assert decode_result(stored) == result
    removal = RemoveKeysResult(
        (True, False), (RemovedBlock("kv1/é", 2**64 - 1, (1, 2)),), 9, 3, True
    )
    assert encode_result(removal)[0] == 12
    assert decode_result(encode_result(removal)) == removal
    # 256 replicas do not fit the packed form's one-byte count: stored as protobuf, whole
    wide = CommitPutsResult((PutOutcome(PUT_COMMITTED, 1, tuple(range(256))),), 1, 1)
    assert encode_result(wide)[0] == 1
    assert decode_result(encode_result(wide)) == wide
    with pytest.raises(ValueError, match="cut short"):
        decode_result(stored[:-1])


def test_results_stored_by_an_earlier_release_still_read() -> None:
    """Snapshots keep the dedupe table: the protobuf forms stored before the packed ones
    (tags 1 and 2) must keep decoding."""
    puts = master_pb2.CommitPutsResponse(revision=8, ring_version=2, stale_ring=False)
    puts.results.add(status=PUT_COMMITTED, version=5, replicas=[1, 2], superseded_write_id=3)
    assert decode_result(bytes([1]) + puts.SerializeToString()) == CommitPutsResult(
        (PutOutcome(PUT_COMMITTED, 5, (1, 2), 3, ()),), 8, 2
    )
    removed = master_pb2.RemoveResponse(removed=[True], revision=4, prefix_removed=1, more=True)
    removed.blocks.add(key="a/b", write_id=6, replicas=[2])
    assert decode_result(bytes([2]) + removed.SerializeToString()) == RemoveKeysResult(
        (True,), (RemovedBlock("a/b", 6, (2,)),), 4, 1, True
    )


def test_batch_results_are_never_stored_whole() -> None:
    with pytest.raises(TypeError):
        encode_result(BatchResult(()))


# --- group commit ---------------------------------------------------------------------------------


class FakeRaft:
    """Applies proposals to a real index after an await, like a Raft commit."""

    def __init__(self, fail: bool = False) -> None:
        self.index = BlockIndex()
        self.index.apply(RegisterMember(os.urandom(16), "n1", 1, "tcp://h:1", "h:2", 10, ""))
        self.proposals: list[CommitPuts | Batch] = []
        self.fail = fail
        self.gate = asyncio.Event()
        self.gate.set()

    async def propose(self, command: SimpleCommand | Batch, timeout_s: float) -> Result:
        assert isinstance(command, CommitPuts | Batch)
        self.proposals.append(command)
        await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail:
            raise UnavailableError("no quorum")
        return self.index.apply(decode(encode(command)))


def entries_in(batch: Batch) -> int:
    return sum(len(c.entries) for c in batch.commands if isinstance(c, CommitPuts))


def puts(n: int, prefix: str) -> CommitPuts:
    items = tuple(PutItem(f"{prefix}/{i}", i + 1, 10, 99, (1,)) for i in range(n))
    return CommitPuts(os.urandom(16), 1, items)


def test_requests_arriving_during_a_commit_share_the_next_raft_entry() -> None:
    async def run() -> None:
        raft = FakeRaft()
        committer = GroupCommitter(raft.propose, max_entries=100, timeout_s=1.0)
        raft.gate.clear()
        first = asyncio.ensure_future(committer.submit(puts(1, "first")))
        await asyncio.sleep(0.01)  # the first proposal is in flight, held at the gate
        rest = [asyncio.ensure_future(committer.submit(puts(2, f"r{i}"))) for i in range(10)]
        await asyncio.sleep(0.01)
        raft.gate.set()
        results = await asyncio.gather(first, *rest)
        assert len(raft.proposals) == 2
        assert isinstance(raft.proposals[1], Batch)
        assert len(raft.proposals[1].commands) == 10
        versions = [o.version for r in results for o in r.outcomes]
        assert len(set(versions)) == 21  # every entry committed once, each with its own version
        assert all(o.status == PUT_COMMITTED for r in results for o in r.outcomes)
        assert committer.stats.requests == 11
        assert committer.stats.raft_entries == 2

    asyncio.run(run())


def test_a_group_never_exceeds_the_entry_limit_and_a_big_request_goes_alone() -> None:
    async def run() -> None:
        raft = FakeRaft()
        committer = GroupCommitter(raft.propose, max_entries=10, timeout_s=1.0)
        raft.gate.clear()
        blocker = asyncio.ensure_future(committer.submit(puts(1, "b")))
        await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(committer.submit(puts(4, f"s{i}"))) for i in range(5)]
        big = asyncio.ensure_future(committer.submit(puts(25, "big")))
        await asyncio.sleep(0.01)
        raft.gate.set()
        await asyncio.gather(blocker, big, *waiting)
        sizes = [
            len(p.entries) if isinstance(p, CommitPuts) else entries_in(p) for p in raft.proposals
        ]
        assert sizes == [1, 8, 8, 4, 25]

    asyncio.run(run())


def test_a_failed_commit_fails_every_request_of_the_group() -> None:
    async def run() -> None:
        raft = FakeRaft(fail=True)
        committer = GroupCommitter(raft.propose, max_entries=100, timeout_s=1.0)
        results = await asyncio.gather(
            *(committer.submit(puts(1, f"f{i}")) for i in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, UnavailableError) for r in results)
        assert len(raft.index) == 0

    asyncio.run(run())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=12))
def test_group_commit_gives_each_request_its_own_result(sizes: list[int]) -> None:
    async def run() -> None:
        raft = FakeRaft()
        committer = GroupCommitter(raft.propose, max_entries=8, timeout_s=1.0)
        requests = [puts(n, f"p{i}") for i, n in enumerate(sizes)]
        results = await asyncio.gather(*(committer.submit(r) for r in requests))
        for request, result in zip(requests, results, strict=True):
            assert len(result.outcomes) == len(request.entries)
            views = raft.index.lookup([e.key for e in request.entries])
            assert [v.version for v in views if v] == [o.version for o in result.outcomes]

    asyncio.run(run())
