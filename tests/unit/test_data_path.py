"""The client's data path against real data servers in this process (a fake master holds the
index): every transport, both clients, the lookup cache, group commit, the transport setting.
Then the pure parts on their own: cache rules, commit batching, HELLO offers."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest

from kvpool import AsyncClient, Client
from kvpool.client.cache import LookupCache
from kvpool.client.commits import CommitBatcher, CommitJob, SyncCommitter
from kvpool.client.links import Links, NodeOffer, read_hello
from kvpool.errors import (
    ConfigError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KVPoolError,
    TransportError,
    UnavailableError,
)
from kvpool.mastercall import MasterRouting, no_rpc_port
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import Op, Status
from kvpool.store_node.data_server import DataConnection
from kvpool.store_node.publish_check import IndexVersions
from kvpool.store_node.shm_server import ShmConnection
from kvpool.transports import host_id
from kvpool.transports.calls import Call
from kvpool.transports.shm import shm_supported
from tests.unit.test_client_core import FakeCluster
from tests.unit.test_hostile_input import FakeIndex
from tests.unit.test_transports import Node

MIB = 1 << 20
SIZES = [0, 1, 4096, 100_000, 3 * MIB]
needs_shm = pytest.mark.skipif(not shm_supported(), reason="shared memory needs Linux")


@dataclass
class RealNode:
    """A real data server standing in for a fake master's node."""

    member_id: int
    node_id: str
    node: Node
    scheme: str = "tcp"

    @property
    def address(self) -> str:
        return self.node.address(self.scheme)

    def member(self) -> common_pb2.Member:
        return common_pb2.Member(
            member_id=self.member_id,
            node_id=self.node_id,
            incarnation=self.member_id,
            data_address=self.address,
            capacity_bytes=1 << 30,
            live=True,
        )


class Cluster:
    """The fake master of test_client_core with two real data servers."""

    def __init__(self, scheme: str = "tcp") -> None:
        self.fake = FakeCluster(n_nodes=0).start()
        self.master = self.fake.master
        self.nodes = [Node(), Node()]
        for i, node in enumerate(self.nodes):
            self.master.nodes[i + 1] = cast(Any, RealNode(i + 1, f"node-{i + 1}", node, scheme))
        self.address = self.fake.master_address

    def close(self) -> None:
        try:
            for node in self.nodes:
                node.close()
        finally:
            self.fake.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def values(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"v{seed}/{n}": rng.randbytes(n) for n in SIZES}


def node_connections(cluster: Cluster) -> list[type]:
    return [type(c) for n in cluster.nodes for c in list(n.server.connections)]


# --- every transport, both clients ------------------------------------------------------------


@pytest.mark.parametrize(
    "transport", ["tcp", pytest.param("shm", marks=needs_shm), "auto", "inproc"]
)
def test_the_sync_client_reads_back_every_byte_over_each_transport(transport: str) -> None:
    cluster = Cluster("inproc" if transport == "inproc" else "tcp")
    try:
        setting = "auto" if transport == "inproc" else transport
        with Client([cluster.address], timeout_s=5.0, transport=setting) as kv:
            vals = values(1)
            assert kv.batch_put(vals) == [True] * len(vals)
            assert kv.batch_get([*vals, "absent"]) == [*vals.values(), None]
            for key, value in vals.items():
                assert kv.get(key) == value
                buf = bytearray(len(value) + 3)
                assert kv.get_into(key, buf) == len(value)
                assert bytes(buf[: len(value)]) == value
            bufs = [np.zeros(len(v) + 1, dtype=np.uint8) for v in vals.values()]
            assert kv.batch_get_into(list(vals), bufs) == [len(v) for v in vals.values()]
            assert [b[: len(v)].tobytes() for b, v in zip(bufs, vals.values(), strict=True)] == [
                *vals.values()
            ]
            assert kv.put("single", b"x" * 5000)
            assert kv.remove("single")
            assert kv.get("single") is None
            kinds = set(node_connections(cluster))
            if transport in ("shm", "auto") and shm_supported():
                assert ShmConnection in kinds  # the node really served shared memory
            else:
                assert kinds == {DataConnection}
            assert kv.stats["misses_by_reason"]["checksum_mismatch"] == 0
    finally:
        cluster.close()


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=needs_shm)])
def test_the_async_client_reads_back_every_byte(cluster: Cluster, transport: str) -> None:
    async def scenario() -> None:
        async with AsyncClient([cluster.address], timeout_s=5.0, transport=transport) as kv:
            vals = values(2)
            assert await kv.batch_put(vals) == [True] * len(vals)
            assert await kv.batch_get([*vals, "absent"]) == [*vals.values(), None]
            bufs = [bytearray(len(v)) for v in vals.values()]
            assert await kv.batch_get_into(list(vals), bufs) == [len(v) for v in vals.values()]
            assert [bytes(b) for b in bufs] == list(vals.values())
            puts = await asyncio.gather(*(kv.put(f"c{i}", b"y" * i) for i in range(40)))
            assert all(puts)
            assert await kv.get("c7") == b"y" * 7
            buf = bytearray(64)
            assert await kv.get_into("c39", buf) == 39
            assert await kv.exists("c1")
            assert await kv.get_or_compute("computed", _compute) == b"from a coroutine"
            assert await kv.get("computed") == b"from a coroutine"
        assert kv.closed

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=needs_shm)])
def test_a_batch_of_empty_values_reads_back_empty(cluster: Cluster, transport: str) -> None:
    """An MGET answer of hits with no bytes at all (an internal error once: the hits' shared
    buffer was of zero bytes, so none was made)."""
    keys = [f"empty/{i}" for i in range(5)]
    with Client([cluster.address], timeout_s=5.0, transport=transport, strict=True) as kv:
        assert kv.batch_put([(k, b"") for k in keys]) == [True] * 5
        assert kv.batch_get([*keys, "absent"]) == [b""] * 5 + [None]
        assert kv.batch_get_into(keys, [bytearray(0) for _ in keys]) == [0] * 5

    async def scenario() -> None:
        async with AsyncClient([cluster.address], timeout_s=5.0, transport=transport) as ak:
            assert await ak.batch_get([*keys, "absent"]) == [b""] * 5 + [None]

    asyncio.run(scenario())


async def _compute() -> bytes:
    return b"from a coroutine"


def test_batch_get_into_refuses_mismatched_buffers(cluster: Cluster) -> None:
    with Client([cluster.address], timeout_s=5.0) as kv:
        assert kv.put("k", b"v" * 10)
        with pytest.raises(InvalidArgumentError):  # InvalidArgumentError
            kv.batch_get_into(["k", "k"], [bytearray(10)])
        with pytest.raises(InvalidArgumentError):
            kv.batch_get_into(["k"], [bytearray(9)])  # too small for the block


def _flip_first_byte(node: Node, keys: set[str], *, last: bool = False) -> int:
    """Change the first byte (``last``: the last) of every stored copy of ``keys`` on ``node``
    (as a bad DIMM or a stray write would): how many copies were changed."""

    def flip() -> int:
        store = node.store
        changed = 0
        for block in list(store._blocks.values()):
            if block.key in keys and block.size_bytes:
                view = store.view(block)
                view[block.size_bytes - 1 if last else 0] ^= 0xFF
                changed += 1
        return changed

    return node.call(flip)


def _with_each_client(
    cluster: Cluster, transport: str, kind: str, scenario: Callable[..., Any]
) -> None:
    """Run ``scenario(kv, wait)`` with a ``Client`` (``kind`` "sync") or an ``AsyncClient``:
    ``await wait(kv.<call>)`` is the call's answer either way."""

    async def done(value: Any) -> Any:
        return value

    async def awaited(value: Any) -> Any:
        return await value

    async def run_async() -> None:
        async with AsyncClient([cluster.address], timeout_s=5.0, transport=transport) as kv:
            await scenario(kv, awaited)

    if kind == "async":
        asyncio.run(run_async())
    else:
        with Client([cluster.address], timeout_s=5.0, transport=transport) as kv:
            asyncio.run(scenario(kv, done))


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=needs_shm)])
def test_bytes_changed_on_the_node_are_a_miss_however_a_batch_receives_them(
    cluster: Cluster, transport: str, kind: str
) -> None:
    """A batch read hashes each block's bytes where they landed (over tcp, as they land): into
    the caller's buffer of the block's size, a larger buffer, a buffer in two pieces, or fresh
    memory (small blocks share one buffer; 64 KiB and up get bytes of their own). Wherever they
    land, a changed block is a checksum miss and its neighbours in the batch are still hits."""
    rng = random.Random(7)
    sizes = [100, 4096, 100_000, 3 * MIB]
    good = {f"good/{n}": rng.randbytes(n) for n in sizes}
    bad = {f"bad/{n}": rng.randbytes(n) for n in sizes}
    size = {k: len(v) for k, v in {**good, **bad}.items()}
    keys = [k for pair in zip(good, bad, strict=True) for k in pair]
    want = [good.get(k) for k in keys]

    async def scenario(kv: Any, wait: Callable[[Any], Any]) -> None:
        assert await wait(kv.batch_put({**good, **bad})) == [True] * len(keys)
        assert sum(_flip_first_byte(n, set(bad)) for n in cluster.nodes) == len(bad)
        assert await wait(kv.batch_get(keys)) == want
        for extra, pieces in ((0, 1), (1, 1), (0, 2)):
            bufs = [bytearray(size[k] + extra) for k in keys]
            into: list[Any] = bufs
            if pieces == 2:
                into = [[memoryview(b)[: len(b) // 2], memoryview(b)[len(b) // 2 :]] for b in bufs]
            got = await wait(kv.batch_get_into(keys, into))
            assert got == [None if v is None else len(v) for v in want]
            for k, b in zip(keys, bufs, strict=True):
                if k in good:
                    assert bytes(b[: size[k]]) == good[k]
        assert kv.stats["misses_by_reason"]["checksum_mismatch"] == 4 * len(bad)

    _with_each_client(cluster, transport, kind, scenario)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=needs_shm)])
def test_bytes_changed_on_the_node_are_a_miss_for_a_one_key_read(
    cluster: Cluster, transport: str, kind: str
) -> None:
    """A one-key get_into over tcp hashes the block as it lands in the caller's buffer (the
    checksum taken between receives, or piece by piece on the event loop, not after): a
    changed block is still a checksum miss, into a buffer of its size, a larger one or two
    pieces, and for get; a good one a hit. The last byte is changed too: a hash that stopped
    short of it would not see it."""
    rng = random.Random(8)
    sizes = (100, 3 * MIB + 5)  # the second: several pieces, the last one short
    good = {f"one/good/{n}": rng.randbytes(n) for n in sizes}
    bad = {f"one/bad/{n}": rng.randbytes(n) for n in sizes}
    last = {f"one/last/{n}": rng.randbytes(n) for n in sizes}

    async def scenario(kv: Any, wait: Callable[[Any], Any]) -> None:
        assert await wait(kv.batch_put({**good, **bad, **last})) == [True] * 6
        assert sum(_flip_first_byte(n, set(bad)) for n in cluster.nodes) == len(bad)
        assert sum(_flip_first_byte(n, set(last), last=True) for n in cluster.nodes) == len(last)
        reads = 0
        for key, value in {**good, **bad, **last}.items():
            for extra, pieces in ((0, 1), (1, 1), (0, 2)):
                buf = bytearray(len(value) + extra)
                view = memoryview(buf)
                into: Any = [view[: len(buf) // 2], view[len(buf) // 2 :]] if pieces == 2 else buf
                got = await wait(kv.get_into(key, into))
                reads += 1
                if key in good:
                    assert got == len(value)
                    assert bytes(buf[: len(value)]) == value
                else:
                    assert got is None
            assert await wait(kv.get(key)) == good.get(key)
            reads += 1
        assert kv.stats["misses_by_reason"]["checksum_mismatch"] == reads * 2 // 3

    _with_each_client(cluster, transport, kind, scenario)


# --- the lookup cache ---------------------------------------------------------------------------


def test_a_cached_key_is_read_without_asking_the_master(cluster: Cluster) -> None:
    with Client([cluster.address], timeout_s=5.0) as kv:
        assert kv.put("hot", b"1" * 100)
        assert kv.get("hot") == b"1" * 100
        lookups = cluster.master.calls.get("Lookup", 0)
        for _ in range(5):
            assert kv.get("hot") == b"1" * 100
        assert kv.batch_get(["hot", "hot"]) == [b"1" * 100] * 2
        assert cluster.master.calls.get("Lookup", 0) == lookups


def test_a_stale_cached_entry_costs_a_lookup_never_a_wrong_or_missed_read(cluster: Cluster) -> None:
    with Client([cluster.address], timeout_s=5.0) as reader, Client([cluster.address]) as writer:
        assert writer.put("k", b"old" * 100)
        assert reader.get("k") == b"old" * 100  # now cached
        assert writer.put("k", b"new" * 100)  # the node drops the old write
        lookups = cluster.master.calls.get("Lookup", 0)
        assert reader.get("k") == b"new" * 100
        assert cluster.master.calls.get("Lookup", 0) == lookups + 1
        assert reader.stats["misses"] == 0
        assert writer.remove("k")
        assert reader.get("k") is None  # the cached entry missed, and the index has no key
        assert reader.stats["misses_by_reason"]["absent"] == 1


def test_own_puts_and_removes_update_cached_entries(cluster: Cluster) -> None:
    with Client([cluster.address], timeout_s=5.0) as kv:
        assert kv.put("k", b"a")
        assert kv.batch_put({"k2": b"c", "k3": b"d"}) == [True, True]
        lookups = cluster.master.calls.get("Lookup", 0)
        assert kv.get("k") == b"a"  # its own writes, never read: no lookup either
        assert kv.batch_get(["k2", "k3"]) == [b"c", b"d"]
        assert cluster.master.calls.get("Lookup", 0) == lookups
        assert kv.put("k", b"b")
        assert kv.get("k") == b"b"  # from the entry the commit answered: no lookup
        assert cluster.master.calls.get("Lookup", 0) == lookups
        assert kv.remove("k")
        assert kv.get("k") is None


def test_the_cache_rules() -> None:
    now = [0.0]
    cache = LookupCache(capacity=8, ttl_s=10.0, clock=lambda: now[0])

    def entry(version: int, write_id: int) -> common_pb2.BlockEntry:
        return common_pb2.BlockEntry(found=True, version=version, write_id=write_id)

    cache.store("k", entry(5, 50), revision=10)
    cache.store("k", entry(4, 40), revision=9)  # an older answer cannot go back in time
    got = cache.get("k")
    assert got is not None
    assert got.write_id == 50
    cache.drop("k", write_id=40)  # names another write: kept
    assert cache.get("k") is not None
    cache.removed("k", revision=12)
    assert cache.get("k") is None
    cache.store("k", entry(6, 60), revision=11)  # answered before the remove: refused
    assert cache.get("k") is None
    cache.store("k", entry(7, 70), revision=13)
    assert cache.get("k") is not None
    now[0] = 11.0
    assert cache.get("k") is None  # expired
    cache.committed("written", entry(1, 1), revision=14)
    got = cache.get("written")  # this client's own write: read back without a lookup
    assert got is not None
    assert got.write_id == 1
    cache.removed("gone", revision=16)
    cache.committed("gone", entry(2, 2), revision=15)  # a commit answered before the remove
    assert cache.get("gone") is None
    for i in range(20):
        cache.store(f"f{i}", entry(1, i + 1), revision=20)
    assert len(cache) <= 8
    assert LookupCache(capacity=0, ttl_s=1.0).get("k") is None


# --- group commit -------------------------------------------------------------------------------


def test_concurrent_puts_of_one_client_share_commit_requests(cluster: Cluster) -> None:
    original = cluster.master.CommitPuts

    async def slow_commit(request: Any, context: Any) -> master_pb2.CommitPutsResponse:
        await asyncio.sleep(0.05)  # a Raft commit in flight: others arrive meanwhile
        response: master_pb2.CommitPutsResponse = await original(request, context)
        return response

    cluster.master.CommitPuts = slow_commit  # type: ignore[method-assign]
    with Client([cluster.address], timeout_s=10.0) as kv:
        results: list[bool] = []

        def writer(w: int) -> None:
            for i in range(5):
                results.append(kv.put(f"w{w}/{i}", bytes([w]) * 100))

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True] * 40
        assert cluster.master.calls["CommitPuts"] < 30  # 40 puts, fewer requests
        assert kv.get("w3/4") == bytes([3]) * 100


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_overwrite_on_a_node_cut_from_the_masters_returns_at_once(
    cluster: Cluster, kind: str
) -> None:
    """A put that replaces a write on the same node waits until that node has handled its
    PUBLISH (the old block leaves there), not for the PUBLISH's answer, which waits for the
    node's check with the index: a whole deadline when the node cannot reach the masters. A
    reader holding the old entry still never reads the old value."""
    cluster.master.report_superseded = True
    old, new = b"old" * 100, b"new" * 100
    masters = FakeIndex()
    masters.cut = True
    versions = [IndexVersions(masters, timeout_s=30.0) for _ in cluster.nodes]
    try:
        with Client([cluster.address], timeout_s=3.0) as reader:
            with Client([cluster.address], timeout_s=3.0) as writer:
                assert writer.put("k", old)
            assert reader.get("k") == old  # its entry is cached now
            for node, v in zip(cluster.nodes, versions, strict=True):
                node.server.versions = v
            started = time.monotonic()
            if kind == "sync":
                with Client([cluster.address], timeout_s=3.0) as writer:
                    assert writer.put("k", new)
            else:

                async def overwrite() -> None:
                    async with AsyncClient([cluster.address], timeout_s=3.0) as awriter:
                        assert await awriter.put("k", new)

                asyncio.run(overwrite())
            assert time.monotonic() - started < 1.5  # not the 3 s deadline
            assert reader.get("k", strict=True) == new
    finally:
        for node, v in zip(cluster.nodes, versions, strict=True):
            node.run(v.close())


def test_the_commit_batcher_groups_by_ring_version_and_size() -> None:
    batcher = CommitBatcher(lambda: 10)

    def job(ring: int, n: int) -> CommitJob:
        return CommitJob(ring, [master_pb2.PutEntry(key=f"k{i}") for i in range(n)], 0.0)

    a, b, c, d = job(1, 4), job(2, 3), job(1, 5), job(1, 2)
    batcher.queue.extend([a, b, c, d])
    assert batcher.take() == [a, c]  # same ring, 9 entries; d would make 11
    assert batcher.take() == [b]
    assert batcher.take() == [d]
    assert batcher.take() == []
    response = master_pb2.CommitPutsResponse(
        revision=7, results=[master_pb2.PutResult(version=v) for v in range(9)]
    )
    CommitBatcher.split([a, c], response)
    assert a.answer is not None
    assert c.answer is not None
    assert [r.version for r in a.answer.results] == [0, 1, 2, 3]
    assert [r.version for r in c.answer.results] == [4, 5, 6, 7, 8]
    assert batcher.requests == 3
    assert batcher.jobs == 4


def test_the_sync_committer_sends_one_request_at_a_time_and_wakes_everyone() -> None:
    sent: list[int] = []
    in_flight = [0]

    def call(request: master_pb2.CommitPutsRequest, deadline: float) -> Any:
        in_flight[0] += 1
        assert in_flight[0] == 1
        time.sleep(0.02)
        sent.append(len(request.entries))
        in_flight[0] -= 1
        return master_pb2.CommitPutsResponse(
            results=[master_pb2.PutResult(version=1) for _ in request.entries]
        )

    committer = SyncCommitter(call, lambda: 100)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            answer = committer.commit(1, [master_pb2.PutEntry(key="k")], time.monotonic() + 5)
            assert len(answer.results) == 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert sum(sent) == 12
    assert len(sent) < 12


# --- the transport setting and HELLO ------------------------------------------------------------


def test_transport_shm_fails_where_a_node_offers_none() -> None:
    fake = FakeCluster(n_nodes=2).start()  # fake nodes: no HELLO, no shared memory
    try:
        with Client([fake.master_address], timeout_s=2.0, transport="shm") as kv:
            assert kv.put("k", b"v") is False
            with pytest.raises(KVPoolError, match="shared memory"):
                kv.put("k", b"v", strict=True)
        with Client([fake.master_address], timeout_s=2.0, transport="auto") as kv:
            assert kv.put("k", b"v")
            assert kv.get("k") == b"v"
    finally:
        fake.stop()
    with pytest.raises(ConfigError, match="transport"):
        Client(["127.0.0.1:1"], transport="udp")


def test_shared_memory_is_offered_only_on_this_host_over_a_direct_connection() -> None:
    def hello(**info: Any) -> Call:
        call = Call(Op.HELLO)
        call.header = cast(Any, type("H", (), {"status": Status.OK})())
        doc = {"features": ["mget", "shm"], "shm": "shm://x", "host": host_id(), **info}
        call.data = memoryview(json.dumps(doc).encode())
        return call

    direct = read_hello(hello(peer="a:1", local="b:2"), local="a:1", peer="b:2")
    assert direct.mget
    assert direct.shm_address == ("shm://x" if shm_supported() else "")
    proxied = read_hello(hello(peer="p:9", local="b:2"), local="a:1", peer="c:3")
    assert proxied.shm_address == ""
    assert "not direct" in proxied.why_not_shm
    elsewhere = read_hello(hello(peer="a:1", local="b:2", host="other"), local="a:1", peer="b:2")
    assert elsewhere.shm_address == ""
    assert Links("tcp").shm_for("tcp://n:1", direct) == ""
    with pytest.raises(TransportError, match="not possible"):
        Links("shm").shm_for("tcp://n:1", proxied)


def test_a_failed_shared_memory_open_asks_again_falls_back_or_gives_up() -> None:
    offer = NodeOffer(mget=True, shm_address="shm://node", trace=False)
    refused = TransportError("connection refused")
    links = Links("auto")
    links.learn("tcp://n:1", offer)
    # A remembered offer: the node may have restarted — forget it and ask again.
    assert links.shm_failed("tcp://n:1", offer, refused, remembered=True) is None
    assert links.offer("tcp://n:1") is None
    # A fresh offer that cannot be reached (another namespace): TCP from now on.
    fallback = links.shm_failed("tcp://n:1", offer, refused, remembered=False)
    assert fallback is not None
    assert not fallback.shm_address
    assert fallback.mget
    assert links.offer("tcp://n:1") == fallback
    # A time-out is a slow or paused node: neither asking again nor TCP would help.
    with pytest.raises(DeadlineExceededError):
        links.shm_failed("tcp://n:2", offer, DeadlineExceededError("slow"), remembered=True)
    # A client that insists on shared memory gives up.
    with pytest.raises(TransportError):
        Links("shm").shm_failed("tcp://n:3", offer, refused, remembered=False)


def test_a_master_that_cannot_say_its_rpc_port_is_called_over_grpc() -> None:
    routing = MasterRouting(["m1:7300", "m2:7300"])
    # Down, slow or refusing us: the caller moves on to another master, nothing is learned.
    for transient in (UnavailableError("down"), DeadlineExceededError("slow")):
        with pytest.raises(type(transient)):
            no_rpc_port(routing, "m1:7300", transient)
        assert routing.rpc_of("m1:7300") is None
    # Anything else (an older or partial master): gRPC for every call to it from now on.
    assert no_rpc_port(routing, "m2:7300", InternalError("unimplemented")) == ""
    assert routing.rpc_of("m2:7300") == ""
