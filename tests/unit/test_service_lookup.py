"""MasterService.Lookup on a fake replicator: the leader under its lease answers; a store
node's own checks (``internal``) are not counted as an engine's prefix chain."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.config import MasterConfig
from kvpool.errors import KVPoolError, NotLeaderError
from kvpool.proto.v1 import master_pb2
from kvpool.raft_master.commands import (
    CommitPuts,
    CommitPutsResult,
    PutItem,
    RegisterMember,
    RegisterMemberResult,
)
from kvpool.raft_master.failure import FailureDetector
from kvpool.raft_master.index import BlockIndex
from kvpool.raft_master.service import MasterService


class Replicator:
    def __init__(self, leading: bool) -> None:
        self.index = BlockIndex()
        self.leading = leading

    def read(self, fn: Callable[[BlockIndex], Any]) -> Any:
        return fn(self.index)

    def lease_held(self) -> bool:
        return self.leading

    def is_leader(self) -> bool:
        return self.leading

    def leader_raft_address(self) -> str | None:
        return None


class Hooks:
    def __init__(self) -> None:
        self.chains: list[list[str]] = []

    def reads_reported(self, counts: list[tuple[str, int]]) -> None:
        pass

    def looked_up(self, keys: list[str]) -> None:
        self.chains.append(keys)


def service(leading: bool = True) -> tuple[MasterService, Hooks]:
    cfg = MasterConfig(raft_secret="s", in_memory=True)
    svc = MasterService(cfg, Replicator(leading), FailureDetector(5.0), grpc_address="m:1")  # type: ignore[arg-type]
    hooks = Hooks()
    svc.replicas = hooks
    return svc, hooks


def test_an_engine_chain_is_linked_and_a_nodes_check_is_not() -> None:
    svc, hooks = service()
    request = master_pb2.LookupRequest(keys=["p/0", "p/1"])
    answer = asyncio.run(svc.Lookup(request, None))
    assert [e.found for e in answer.entries] == [False, False]
    internal = master_pb2.LookupRequest(keys=["n/0", "n/1"], internal=True)
    asyncio.run(svc.Lookup(internal, None))
    assert hooks.chains == [["p/0", "p/1"]]


def test_a_follower_refuses_lookups() -> None:
    svc, _ = service(leading=False)
    with pytest.raises(NotLeaderError):
        asyncio.run(svc.Lookup(master_pb2.LookupRequest(keys=["k"]), None))


def test_prefix_match_answers_each_key_only_when_asked() -> None:
    svc, _ = service()
    index = svc.replicator.index  # type: ignore[attr-defined]
    member = index.apply(RegisterMember(b"r" * 16, "n1", 1, "tcp://n1:1", "", 100, ""))
    assert isinstance(member, RegisterMemberResult)
    items = tuple(PutItem(k, i + 1, 4, 7, (member.member_id,)) for i, k in enumerate(["a", "c"]))
    assert isinstance(
        index.apply(CommitPuts(b"p" * 16, index.ring_version, items)), CommitPutsResult
    )
    keys = ["a", "b", "c"]
    plain = asyncio.run(svc.PrefixMatch(master_pb2.PrefixMatchRequest(keys=keys), None))
    assert (plain.matched, list(plain.found)) == (1, [])  # the count only, as before
    each = asyncio.run(svc.PrefixMatch(master_pb2.PrefixMatchRequest(keys=keys, each=True), None))
    assert (each.matched, list(each.found)) == (1, [True, False, True])
    assert each.revision == index.revision


def _stored(svc: MasterService, keys: list[str]) -> BlockIndex:
    index: BlockIndex = svc.replicator.index  # type: ignore[attr-defined]
    member = index.apply(RegisterMember(b"r" * 16, "n1", 1, "tcp://n1:1", "", 100, ""))
    assert isinstance(member, RegisterMemberResult)
    items = tuple(PutItem(k, i + 1, 4, 7, (member.member_id,)) for i, k in enumerate(keys))
    assert isinstance(
        index.apply(CommitPuts(b"p" * 16, index.ring_version, items)), CommitPutsResult
    )
    return index


def test_a_read_answered_now_is_the_answer_the_async_method_gives() -> None:
    svc, hooks = service()
    _stored(svc, ["a", "c"])
    requests: list[tuple[str, Any]] = [
        ("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a", "b", "c"])),
        ("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a", "b", "c"], each=True)),
        ("Lookup", master_pb2.LookupRequest(keys=["a", "b", "c"])),
        ("GetMembers", master_pb2.GetMembersRequest()),
    ]
    for method, request in requests:
        now = svc.read_now(method, request)
        assert now is not None, method
        assert now == asyncio.run(getattr(svc, method)(request, None)), method
    # a chain looked up now is linked for the hot-prefix replicas, as through the async method
    assert hooks.chains == [["a", "b", "c"]] * 2


def test_a_read_that_would_wait_is_not_answered_now() -> None:
    svc, _ = service()
    index = _stored(svc, ["a"])
    ahead = master_pb2.LookupRequest(keys=["a"], min_revision=index.revision + 1)
    assert svc.read_now("Lookup", ahead) is None  # the async method waits for the revision
    caught_up = master_pb2.PrefixMatchRequest(keys=["a"], min_revision=index.revision)
    answer = svc.read_now("PrefixMatch", caught_up)
    assert isinstance(answer, master_pb2.PrefixMatchResponse)
    assert answer.matched == 1
    assert svc.read_now("Remove", master_pb2.RemoveRequest(keys=["a"])) is None  # not a read
    follower, _ = service(leading=False)  # no read lease: the async method waits or refuses
    assert follower.read_now("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a"])) is None


def test_a_read_answered_now_checks_its_request_as_the_async_method_does() -> None:
    svc, _ = service()
    svc.cfg = dataclasses.replace(svc.cfg, max_lookup_keys=2)
    with pytest.raises(KVPoolError):
        svc.read_now("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a", "b", "c"]))
    with pytest.raises(KVPoolError):
        svc.read_now("Lookup", master_pb2.LookupRequest(keys=["a", ""]))
