"""The client SDK against in-process fakes: a fake Master gRPC servicer and fake store nodes that
keep blocks in a dict, all on loopback in a background event-loop thread.

The fakes follow the contract (proto/v1/master.proto, proto/wire.py) the simplest honest way;
they are no stand-in for the real master and node, which the integration tests cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpool import Client, tracing
from kvpool.checksum import block_checksum
from kvpool.client import state as state_module
from kvpool.client.core import ClientCore
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.settings import make_config
from kvpool.errors import (
    BlockMissError,
    BufferTooSmallError,
    ChecksumMismatchError,
    ConfigError,
    DeadlineExceededError,
    InternalError,
    InvalidKeyError,
    InvalidValueError,
    NoNodesError,
    UnavailableError,
    ValueTooLargeError,
)
from kvpool.grpcutil import ServerHandle, start_server
from kvpool.proto.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.proto.wire import MAX_KEY_BYTES, Header, MissReason, Op, Status
from tests.frame_server import FrameServerProtocol, start_frame_server

T = TypeVar("T")

# --- fakes -----------------------------------------------------------------------------------


@dataclass
class Block:
    data: bytes
    checksum: int
    published: bool = False


class FakeNodeProtocol(FrameServerProtocol):
    def __init__(self, node: FakeNode) -> None:
        super().__init__()
        self.node = node

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.node.conns.append(self)

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        return memoryview(bytearray(header.payload_len)) if header.op == Op.PUT else None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        node = self.node
        node.ops.append((Op(header.op), key.decode()))
        if node.silent:
            return  # a node that accepts frames and never answers
        reply = Header(op=header.op, request_id=header.request_id, write_id=header.write_id)
        if header.op in (Op.AUTH, Op.HELLO) and node.opening_delay_s:  # slow to admit
            asyncio.get_running_loop().call_later(node.opening_delay_s, self.send, reply)
            return
        ident = (key, header.write_id)
        if header.op == Op.PUT:
            data = bytes(payload) if payload is not None else b""
            if node.no_space:
                self.send_error(header, Status.NO_SPACE, "full")
                return
            if block_checksum(data) != header.checksum:
                self.send_error(header, Status.CHECKSUM_MISMATCH, "payload does not match")
                return
            node.blocks[ident] = Block(data, header.checksum)
            if node.answer_puts_after_commit:
                self._answer_after_commit(reply, key.decode(), header.write_id, 0)
                return
            self.send(reply)
        elif header.op == Op.PUBLISH:
            if ident in node.blocks:
                node.blocks[ident].published = True
            self.send(reply)
        elif header.op == Op.DELETE:
            node.blocks.pop(ident, None)
            self.send(reply)
        elif header.op == Op.GET:
            block = node.blocks.get(ident)  # staged or published: the exact write id (as a node)
            if block is None:
                reason = MissReason.ABSENT
                if any(k == key for k, _ in node.blocks):
                    reason = MissReason.WRONG_VERSION
                self.send(reply._replace(status=Status.MISS, flags=reason))
                return
            data = block.data
            if node.corrupt and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            checksum = block.checksum ^ 1 if node.wrong_header_checksum else block.checksum
            answer = Header(
                op=header.op,
                request_id=header.request_id,
                write_id=header.write_id,
                payload_len=len(data),
                checksum=checksum,
            )
            if node.delay_s:  # a slow node: answers, late
                asyncio.get_running_loop().call_later(node.delay_s, self.send, answer, b"", data)
            else:
                self.send(answer, b"", data)
        else:
            self.send(reply)

    def _answer_after_commit(self, reply: Header, key: str, write_id: int, waited: int) -> None:
        """Answer the PUT once the master holds its commit (or after a second): record
        which."""
        master = self.node.master
        committed = master is not None and any(
            e.key == key and e.write_id == write_id
            for method, request in master.requests
            if method == "CommitPuts"
            for e in request.entries
        )
        if committed or waited >= 1000:
            self.node.answered_after_commit.append(committed)
            self.send(reply)
            return
        loop = asyncio.get_running_loop()
        loop.call_later(0.001, self._answer_after_commit, reply, key, write_id, waited + 1)


@dataclass
class FakeNode:
    member_id: int
    node_id: str
    blocks: dict[tuple[bytes, int], Block] = field(default_factory=dict)
    ops: list[tuple[Op, str]] = field(default_factory=list)
    conns: list[FakeNodeProtocol] = field(default_factory=list)
    silent: bool = False
    corrupt: bool = False
    wrong_header_checksum: bool = False
    no_space: bool = False
    delay_s: float = 0.0
    opening_delay_s: float = 0.0  # before answering AUTH and HELLO
    answer_puts_after_commit: bool = False  # hold a PUT's answer until the master has its commit
    answered_after_commit: list[bool] = field(default_factory=list)
    master: FakeMaster | None = None
    port: int = 0
    server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def member(self) -> common_pb2.Member:
        return common_pb2.Member(
            member_id=self.member_id,
            node_id=self.node_id,
            incarnation=self.member_id,
            data_address=self.address,
            capacity_bytes=1 << 30,
            live=True,
        )


def _close_node(node: FakeNode) -> None:
    if node.server is not None:
        node.server.close()
    for conn in node.conns:
        if conn.transport is not None:
            conn.transport.abort()
    node.conns.clear()


@dataclass
class Entry:
    version: int
    write_id: int
    size_bytes: int
    checksum: int
    replicas: list[int]


class FakeMaster(master_pb2_grpc.MasterServicer):
    """The index in a dict: versions per key, a revision per mutation, request-id dedupe."""

    def __init__(self) -> None:
        self.nodes: dict[int, FakeNode] = {}
        self.down: set[int] = set()  # members the index knows as down (still on the ring)
        self.ring_version = 1
        self.index: dict[str, Entry] = {}
        self.revision = 0
        self.calls: dict[str, int] = {}
        self.requests: list[Any] = []
        self.seen: dict[bytes, Any] = {}
        self.report_superseded = False
        """Name the write each commit replaces, and where it was (as the real index does)."""
        self.applied_revision: int | None = None  # None: caught up; else a lagging view
        self.commit_delay_s = 0.0  # a slow commit (an election under way)

    def _count(self, method: str, request: Any) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        self.requests.append((method, request))

    def _live(self) -> list[common_pb2.Member]:
        return [n.member() for mid, n in sorted(self.nodes.items()) if mid not in self.down]

    async def GetMembers(self, request: Any, context: Any) -> master_pb2.GetMembersResponse:
        self._count("GetMembers", request)
        return master_pb2.GetMembersResponse(ring_version=self.ring_version, members=self._live())

    async def CommitPuts(self, request: Any, context: Any) -> master_pb2.CommitPutsResponse:
        self._count("CommitPuts", request)
        if self.commit_delay_s:
            await asyncio.sleep(self.commit_delay_s)
        if request.request_id in self.seen:
            return self.seen[request.request_id]  # type: ignore[no-any-return]
        if request.ring_version != self.ring_version:
            return master_pb2.CommitPutsResponse(stale_ring=True, ring_version=self.ring_version)
        self.revision += 1
        results = []
        for e in request.entries:
            kept = [r for r in e.replicas if r in self.nodes and r not in self.down]
            if not kept:
                results.append(master_pb2.PutResult(status=master_pb2.PUT_STATUS_NO_LIVE_REPLICA))
                continue
            old = self.index.get(e.key)
            version = (old.version if old else 0) + 1
            self.index[e.key] = Entry(version, e.write_id, e.size_bytes, e.checksum, kept)
            result = master_pb2.PutResult(
                status=master_pb2.PUT_STATUS_COMMITTED, version=version, replicas=kept
            )
            if old is not None and self.report_superseded:
                result.superseded_write_id = old.write_id
                result.superseded_replicas.extend(old.replicas)
            results.append(result)
        response = master_pb2.CommitPutsResponse(
            results=results, revision=self.revision, ring_version=self.ring_version
        )
        self.seen[request.request_id] = response
        return response

    def _entry(self, key: str) -> common_pb2.BlockEntry:
        e = self.index.get(key)
        if e is None:
            return common_pb2.BlockEntry(key=key, found=False)
        return common_pb2.BlockEntry(
            key=key,
            found=True,
            version=e.version,
            write_id=e.write_id,
            size_bytes=e.size_bytes,
            checksum=e.checksum,
            replicas=e.replicas,
        )

    async def Lookup(self, request: Any, context: Any) -> master_pb2.LookupResponse:
        self._count("Lookup", request)
        entries = [self._entry(k) for k in request.keys]
        named = {r for e in entries for r in e.replicas}
        return master_pb2.LookupResponse(
            entries=entries,
            members=[m for m in self._live() if m.member_id in named],
            revision=self.revision,
            ring_version=self.ring_version,
        )

    async def PrefixMatch(self, request: Any, context: Any) -> master_pb2.PrefixMatchResponse:
        self._count("PrefixMatch", request)
        matched = 0
        for key in request.keys:
            if key not in self.index:
                break
            matched += 1
        return master_pb2.PrefixMatchResponse(matched=matched, revision=self.revision)

    async def Remove(self, request: Any, context: Any) -> master_pb2.RemoveResponse:
        self._count("Remove", request)
        if request.request_id in self.seen:
            return self.seen[request.request_id]  # type: ignore[no-any-return]
        self.revision += 1
        removed, blocks = [], []
        for key in request.keys:
            e = self.index.pop(key, None)
            removed.append(e is not None)
            if e is not None:
                blocks.append(
                    master_pb2.RemovedBlock(key=key, write_id=e.write_id, replicas=e.replicas)
                )
        named = {r for b in blocks for r in b.replicas}
        response = master_pb2.RemoveResponse(
            removed=removed,
            blocks=blocks,
            members=[m for m in self._live() if m.member_id in named],
            revision=self.revision,
        )
        self.seen[request.request_id] = response
        return response

    async def ReportEvictions(self, request: Any, context: Any) -> Any:
        """A replica that does not hold a block leaves the index — only while the key still
        names that write (a put takes back a replica that did not stage what it committed)."""
        self._count("ReportEvictions", request)
        dropped = 0
        for block in request.blocks:
            e = self.index.get(block.key)
            if e is None or e.write_id != block.write_id or request.member_id not in e.replicas:
                continue
            e.replicas = [r for r in e.replicas if r != request.member_id]
            if not e.replicas:
                del self.index[block.key]
            dropped += 1
        if dropped:
            self.revision += 1
        return master_pb2.ReportEvictionsResponse(dropped=dropped, revision=self.revision)

    # Node-facing calls: the fake nodes never register; the client never calls these.
    async def RegisterNode(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def LeaveNode(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def ClusterStatus(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def ClaimReplicas(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def Pin(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def DrainNode(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")

    async def ReplicaStatus(self, request: Any, context: Any) -> Any:
        raise InternalError("not in the fake")


class FakeCluster:
    """One fake master and ``n_nodes`` fake nodes on a background event-loop thread."""

    def __init__(self, n_nodes: int = 2) -> None:
        self.master = FakeMaster()
        self.nodes = [FakeNode(member_id=i + 1, node_id=f"node-{i + 1}") for i in range(n_nodes)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.handle: ServerHandle | None = None
        self.master_address = ""

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def start(self) -> FakeCluster:
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self.handle = await start_server(
            "127.0.0.1:0",
            [(master_pb2_grpc.add_MasterServicer_to_server, self.master, "kvpool.v1.Master")],
        )
        await self.handle.set_ready(True)
        self.master_address = f"127.0.0.1:{self.handle.port}"
        for node in self.nodes:
            await self._start_node(node)

    async def _start_node(self, node: FakeNode) -> None:
        node.server, node.port = await start_frame_server(
            "127.0.0.1", node.port, lambda: FakeNodeProtocol(node)
        )
        self.master.nodes[node.member_id] = node
        node.master = self.master

    def add_node(self) -> FakeNode:
        node = FakeNode(member_id=len(self.nodes) + 1, node_id=f"node-{len(self.nodes) + 1}")
        self.nodes.append(node)
        self.run(self._start_node(node))
        self.master.ring_version += 1
        return node

    def stop_node(self, node: FakeNode) -> None:
        """The node's process is gone: its port refuses connections, the index not told yet."""

        async def stop() -> None:
            _close_node(node)

        self.run(stop())

    def stop(self) -> None:
        async def stop_all() -> None:
            for node in self.nodes:
                _close_node(node)
            if self.handle is not None:
                await self.handle.stop(0)

        try:
            if self.thread.is_alive():
                self.run(stop_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            self.loop.close()


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster(n_nodes=2).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client_factory(cluster: FakeCluster) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(**kwargs: Any) -> Client:
        kwargs.setdefault("timeout_s", 1.0)
        c = Client([cluster.master_address], **kwargs)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def client(client_factory: Callable[..., Client]) -> Client:
    return client_factory()


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """A port that completes TCP handshakes (kernel backlog) and never speaks."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    return set(threading.enumerate()) - before


# --- round trips ------------------------------------------------------------------------------


def test_put_get_round_trip_for_every_value_type(client: Client) -> None:
    arr = np.arange(1024, dtype=np.float16).reshape(32, 32)
    values: dict[str, Any] = {
        "bytes": b"hello kv block",
        "bytearray": bytearray(b"\x00\x01" * 3000),
        "memoryview": memoryview(b"abcdef" * 100),
        "memoryview-2d": np.arange(12, dtype=np.int32).reshape(3, 4).data,
        "numpy": arr,
        "empty": b"",
        "unicode-key-\u00e9\u4e2d": b"x",
    }
    for key, value in values.items():
        assert client.put(key, value) is True, key
    for key, value in values.items():
        got = client.get(key)
        assert type(got) is bytes
        expected = value.tobytes() if isinstance(value, np.ndarray) else bytes(value)
        assert got == expected, key
    back = np.frombuffer(client.get("numpy") or b"", dtype=np.float16).reshape(32, 32)
    assert np.array_equal(back, arr)
    assert client.stats["hits"] == len(values) + 1
    assert client.stats["puts_ok"] == len(values)


def test_get_of_an_absent_key_is_a_miss(client: Client) -> None:
    assert client.get("never-put") is None
    assert client.stats["misses_by_reason"]["absent"] == 1
    with pytest.raises(BlockMissError) as info:
        client.get("never-put", strict=True)
    assert info.value.reason == "absent"


def test_put_overwrites_whole_and_never_reuses_a_write_id(
    client: Client, cluster: FakeCluster
) -> None:
    for i in range(5):
        assert client.put("k", bytes([i]) * 100)
    assert client.get("k") == bytes([4]) * 100
    write_ids = [
        e.write_id
        for method, req in cluster.master.requests
        if method == "CommitPuts"
        for e in req.entries
    ]
    assert len(write_ids) == 5
    assert len(set(write_ids)) == 5
    assert all(0 < w < 2**64 for w in write_ids)
    assert cluster.master.index["k"].version == 5


def test_put_sends_bytes_to_the_ring_placement_and_publishes(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory(replicas=2)
    assert kv.put("two-copies", b"payload")
    entry = cluster.master.index["two-copies"]
    assert sorted(entry.replicas) == [1, 2]
    assert kv.get("two-copies") == b"payload"  # served staged or published, never waited for
    deadline = time.monotonic() + 5
    for node in cluster.nodes:
        block = node.blocks[(b"two-copies", entry.write_id)]
        assert block.data == b"payload"
        while not block.published:  # PUBLISH is sent after the commit, not waited for
            assert time.monotonic() < deadline, f"{node.node_id} never got the PUBLISH"
            time.sleep(0.01)


def test_read_your_writes_floor_is_sent_with_lookups(client: Client, cluster: FakeCluster) -> None:
    assert client.put("a", b"1")
    assert client.put("b", b"2")
    assert client.get("a") == b"1"  # its own write: cached, no lookup
    assert client.get("c") is None  # a key it never wrote: looked up, at least at its floor
    lookups = [r for m, r in cluster.master.requests if m == "Lookup"]
    assert lookups[-1].min_revision == cluster.master.revision == 2


# --- batches ----------------------------------------------------------------------------------


def test_batch_put_and_get_use_one_master_call_each(client: Client, cluster: FakeCluster) -> None:
    items = {f"blk/{i}": bytes([i]) * (100 + i) for i in range(50)}
    assert client.batch_put(items) == [True] * 50
    assert cluster.master.calls["CommitPuts"] == 1
    keys = [*items, "missing"]
    got = client.batch_get(keys)
    assert cluster.master.calls["Lookup"] == 1
    assert got[:-1] == list(items.values())
    assert got[-1] is None
    assert client.batch_put([("p", b"1"), ("q", bytearray(b"2"))]) == [True, True]
    assert client.batch_get(["q", "p"]) == [b"2", b"1"]
    assert client.batch_put({}) == []
    assert client.batch_get([]) == []


def test_huge_batch_put_commits_in_chunks(
    client: Client, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "MAX_COMMIT_ENTRIES", 10)
    items = {f"blk/{i}": b"v%d" % i for i in range(25)}
    assert client.batch_put(items) == [True] * 25
    commits = [r for m, r in cluster.master.requests if m == "CommitPuts"]
    assert sorted(len(r.entries) for r in commits) == [5, 10, 10]
    assert len({r.request_id for r in commits}) == 3
    assert client.batch_get(list(items)) == list(items.values())


def test_batch_put_reports_each_key(client: Client, cluster: FakeCluster) -> None:
    cluster.nodes[0].no_space = True
    keys = [f"k{i}" for i in range(40)]
    results = client.batch_put(dict.fromkeys(keys, b"v"))
    # Keys placed on the full node fail, the others commit (one replica each).
    on_full = {k for k in keys if client._placement.place(k.encode(), 1)[0].member_id == 1}
    assert 0 < len(on_full) < len(keys)
    assert results == [k not in on_full for k in keys]
    # Committed while the bytes were on their way, the keys the full node refused were taken
    # out of the index again (conditional on their write ids).
    assert set(cluster.master.index) == set(keys) - on_full
    assert cluster.master.calls["ReportEvictions"] == 1
    stats = client.stats
    assert stats["puts_failed"] == len(on_full)
    assert stats["puts_ok"] == len(keys) - len(on_full)


def test_prefix_match_exists_and_remove(client: Client, cluster: FakeCluster) -> None:
    chain = [f"chain/{i}" for i in range(6)]
    assert client.batch_put(dict.fromkeys(chain[:4], b"x")) == [True] * 4
    assert client.prefix_match(chain) == 4
    assert client.prefix_match([]) == 0
    assert client.exists("chain/0")
    assert not client.exists("chain/5")
    write_id = cluster.master.index["chain/0"].write_id
    holder = next(n for n in cluster.nodes if (b"chain/0", write_id) in n.blocks)
    assert client.remove("chain/0") is True
    assert (b"chain/0", write_id) not in holder.blocks  # DELETE reached the replica
    assert client.remove("chain/0") is False
    assert client.get("chain/0") is None
    assert client.prefix_match(chain) == 0


def test_prefix_match_then_a_batch_get_of_the_hits_asks_the_index_once(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    """The engine flow (SGLang, LMCache): how many blocks are cached, then read them."""
    chain = [f"engine/{i}" for i in range(8)]
    values = [k.encode() * 10 for k in chain[:5]]
    assert client_factory().batch_put(dict(zip(chain, values, strict=False))) == [True] * 5
    fresh = client_factory()  # another engine: nothing cached

    def index_calls() -> int:
        return sum(cluster.master.calls.get(m, 0) for m in ("Lookup", "PrefixMatch"))

    before = index_calls()
    matched = fresh.prefix_match(chain)
    assert matched == 5
    assert fresh.batch_get(chain[:matched]) == values
    assert index_calls() - before == 1


def test_batch_exists_asks_once_and_falls_back_to_a_lookup_on_an_older_master(
    client: Client, cluster: FakeCluster
) -> None:
    """This fake master answers PrefixMatch as a release before per-key answers did."""
    keys = [f"ex/{i}" for i in range(5)]
    assert client.batch_put(dict.fromkeys(keys[:3], b"v")) == [True] * 3
    assert client.remove("ex/1")
    calls = cluster.master.calls
    before = (calls.get("PrefixMatch", 0), calls.get("Lookup", 0))
    assert client.batch_exists(keys) == [True, False, True, False, False]
    assert (calls.get("PrefixMatch", 0), calls.get("Lookup", 0)) == (before[0] + 1, before[1] + 1)
    assert client.batch_exists([]) == []


def test_a_count_only_prefix_match_asks_prefix_match_and_the_read_looks_up(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    """fetch_entries=False (SGLang's hit query): the master counts, no entry is sent or
    cached, and the get of the hits that may follow asks its own Lookup."""
    chain = [f"probe/{i}" for i in range(8)]
    values = [k.encode() * 10 for k in chain[:5]]
    assert client_factory().batch_put(dict(zip(chain, values, strict=False))) == [True] * 5
    fresh = client_factory()
    calls = cluster.master.calls
    before = (calls.get("PrefixMatch", 0), calls.get("Lookup", 0))
    assert fresh.prefix_match(chain, fetch_entries=False) == 5
    assert (calls.get("PrefixMatch", 0), calls.get("Lookup", 0)) == (before[0] + 1, before[1])
    assert fresh.batch_get(chain[:5]) == values
    assert calls.get("Lookup", 0) == before[1] + 1


# --- data errors become misses ----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["corrupt", "wrong_header_checksum"])
def test_checksum_mismatch_is_a_miss_or_strict_error(
    client: Client, cluster: FakeCluster, fault: str
) -> None:
    assert client.put("blk", b"precious bytes" * 100)
    for node in cluster.nodes:
        setattr(node, fault, True)
    assert client.get("blk") is None
    assert client.stats["misses_by_reason"]["checksum_mismatch"] == 1
    with pytest.raises(ChecksumMismatchError):
        client.get("blk", strict=True)
    buf = bytearray(2000)
    assert client.get_into("blk", buf) is None
    assert client.batch_get(["blk"]) == [None]


def test_a_bad_replica_falls_back_to_a_good_one(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory(replicas=2)
    assert kv.put("blk", b"good" * 1000)
    first = cluster.master.index["blk"].replicas[0]
    cluster.master.nodes[first].corrupt = True
    for _ in range(20):  # reads start at a random replica: some hit the corrupt one first
        assert kv.get("blk") == b"good" * 1000
    assert 1 <= kv.stats["replica_retries"] < 20
    assert kv.stats["misses"] == 0
    cluster.stop_node(cluster.master.nodes[first])
    before = kv.stats["replica_retries"]
    for _ in range(60):
        assert kv.get("blk") == b"good" * 1000
        if kv.stats["replica_retries"] > before:
            break  # this read tried the dead node first
    else:
        pytest.fail("no read started at the dead replica")
    # The dead node is now suspect: later reads go to the live replica first.
    retries = kv.stats["replica_retries"]
    for _ in range(10):
        assert kv.get("blk") == b"good" * 1000
    assert kv.stats["replica_retries"] == retries


def test_node_that_never_answers_costs_one_deadline(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory(timeout_s=0.5)
    assert kv.put("blk", b"x" * 4096)
    for node in cluster.nodes:
        node.silent = True
    start = time.monotonic()
    assert kv.get("blk") is None
    elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 0.5 + 0.3
    assert kv.stats["misses_by_reason"]["timeout"] == 1
    # Held back now (node_retry_ms): the next read of a block held only there misses at once.
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="failed a request moments ago"):
        kv.get("blk", strict=True)
    assert time.monotonic() - start < 0.1
    start = time.monotonic()
    assert kv.put("other", b"y") is False
    assert time.monotonic() - start < 0.8


@pytest.mark.parametrize("retry_ms", [600, 0])
def test_a_silent_node_is_held_back_then_tried_again(
    client_factory: Callable[..., Client], cluster: FakeCluster, retry_ms: int
) -> None:
    # A node that stops answering (SIGSTOP, a frozen VM) costs one deadline, then nothing for
    # node_retry_ms; after that one read tries it, and once it answers it is read as before.
    # With node_retry_ms=0 every read waits out its deadline.
    kv = client_factory(timeout_s=0.5, node_retry_ms=retry_ms)
    assert kv.put("blk", b"x" * 4096)
    for node in cluster.nodes:
        node.silent = True
    waits = []
    for _ in range(20 if retry_ms else 2):
        start = time.monotonic()
        assert kv.get("blk") is None
        waits.append(time.monotonic() - start)
    assert waits[0] > 0.4  # the first read finds out
    if not retry_ms:
        assert waits[1] > 0.4
        assert kv.stats["misses_by_reason"]["timeout"] == 2
        return
    assert max(waits[1:]) < 0.1
    assert kv.stats["misses_by_reason"]["node_down"] == 19
    assert kv.stats["node_holds"] == 1
    for node in cluster.nodes:
        node.silent = False
    time.sleep(0.65)
    assert kv.get("blk") == b"x" * 4096  # the probe: answered, the hold ends
    assert kv.get("blk") == b"x" * 4096


def test_opening_a_connection_is_bounded_by_the_calls_deadline_not_once_per_step(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    # A connection is opened in steps (connect, AUTH, HELLO); each once had the whole time-out,
    # so a node slow to admit (a lossy link, an overloaded node) cost a call twice its deadline.
    token = "s3cret-s3cret-s3cret"
    kv = client_factory(timeout_s=0.5, cluster_token=token)
    assert kv.put("blk", b"x" * 4096)
    kv.close()
    kv = client_factory(timeout_s=0.5, cluster_token=token)
    for node in cluster.nodes:
        node.opening_delay_s = 0.45
    start = time.monotonic()
    assert kv.get("blk") is None  # AUTH answered at 0.45 s, HELLO would be at 0.9 s
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 0.2, f"the get took {elapsed:.2f}s with a 0.5 s deadline"


def test_the_async_core_opens_a_connection_within_the_calls_deadline(
    cluster: FakeCluster,
) -> None:
    async def main() -> None:
        config = make_config(
            [cluster.master_address], timeout_s=0.5, cluster_token="s3cret-s3cret-s3cret"
        )
        core = ClientCore(config)
        try:
            assert await core.put("blk", b"x" * 4096)
        finally:
            await core.close()
        for node in cluster.nodes:
            node.opening_delay_s = 0.45
        core = ClientCore(config)
        try:
            start = time.monotonic()
            assert await core.get("blk") is None
            elapsed = time.monotonic() - start
        finally:
            await core.close()
        assert elapsed < 0.5 + 0.2, f"the get took {elapsed:.2f}s with a 0.5 s deadline"

    asyncio.run(main())


def test_warm_up_connects_every_node_and_another_threads_calls_use_those_connections(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory()
    report = kv.warm_up()
    assert report.ok, report.summary()
    assert report.nodes == {"node-1": "", "node-2": ""}
    assert "2 of 2 node(s) connected" in report.summary()
    assert [len(node.conns) for node in cluster.nodes] == [1, 1]

    def work() -> None:
        for i in range(8):
            assert kv.put(f"k{i}", b"v%d" % i)
            assert kv.get(f"k{i}") == b"v%d" % i

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(10)
    assert {key for node in cluster.nodes for _, key in node.ops} >= {"k0", "k7"}
    assert [len(node.conns) for node in cluster.nodes] == [1, 1]  # no connection opened
    kv.close()
    with pytest.raises(UnavailableError):
        kv.warm_up()


def test_a_warm_up_for_the_index_only_opens_no_node_connection(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory()
    before = dict(cluster.master.calls)
    report = kv.warm_up(nodes=False)
    assert report.ok, report.summary()
    assert report.nodes == {}
    assert "no node connection opened" in report.summary()
    calls = {m: n - before.get(m, 0) for m, n in cluster.master.calls.items()}
    # The leader found by a Lookup, then the ring (a GetMembers more: learning that this
    # master has no RPC port); nothing else asked.
    assert {m: n for m, n in calls.items() if n} == {"Lookup": 1, "GetMembers": 2}
    assert [len(node.conns) for node in cluster.nodes] == [0, 0]


def test_warm_up_says_which_node_it_could_not_reach_and_does_not_raise(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    cluster.stop_node(cluster.nodes[1])  # the index still lists it
    report = client_factory(timeout_s=0.5).warm_up()
    assert not report.ok
    assert report.nodes["node-1"] == ""
    assert report.nodes["node-2"]  # why not
    assert "1 of 2 node(s) connected" in report.summary()
    assert "node-2" in report.summary()


def test_the_async_core_warms_up_its_pool(cluster: FakeCluster) -> None:
    async def main() -> None:
        config = make_config([cluster.master_address], timeout_s=1.0, connections_per_node=2)
        core = ClientCore(config)
        try:
            report = await core.warm_up()
            assert report.ok, report.summary()
            assert set(report.nodes) == {"node-1", "node-2"}
            # The pool, full (a connection without HELLO is open before the node's loop has
            # seen it: give it a moment).
            for _ in range(100):
                if [len(node.conns) for node in cluster.nodes] == [2, 2]:
                    break
                await asyncio.sleep(0.01)
            assert [len(node.conns) for node in cluster.nodes] == [2, 2]
            for i in range(8):
                assert await core.put(f"k{i}", b"v")
            assert [len(node.conns) for node in cluster.nodes] == [2, 2]
        finally:
            await core.close()

    asyncio.run(main())


def test_node_down_on_put_keeps_the_other_replica(
    client_factory: Callable[..., Client], cluster: FakeCluster
) -> None:
    kv = client_factory(replicas=2)
    cluster.stop_node(cluster.nodes[0])
    assert kv.put("blk", b"data") is True
    assert cluster.master.index["blk"].replicas == [2]
    assert kv.get("blk") == b"data"


def async_put(cluster: FakeCluster, key: str, value: bytes, *, timeout_s: float) -> bool:
    """One put through the event-loop driver (``ClientCore``, opened and closed for it)."""

    async def main() -> bool:
        core = ClientCore(make_config([cluster.master_address], timeout_s=timeout_s))
        try:
            return await core.put(key, value)
        finally:
            await core.close()

    return asyncio.run(main())


def test_a_put_commits_while_the_node_takes_the_bytes(client: Client, cluster: FakeCluster) -> None:
    """The commit goes before the PUT's answer is read: a node that answers only once the
    index holds the commit answers at once, for either driver, and the put succeeds."""
    for node in cluster.nodes:
        node.answer_puts_after_commit = True
    assert client.put("blk", b"data")
    assert client.batch_put({f"k{i}": b"v" for i in range(16)}) == [True] * 16

    assert async_put(cluster, "ablk", b"data", timeout_s=1.0)
    answers = [a for node in cluster.nodes for a in node.answered_after_commit]
    assert len(answers) >= 3
    assert all(answers)
    assert "ReportEvictions" not in cluster.master.calls
    assert client.get("blk") == b"data"


def test_a_commit_that_outlasts_the_stages_deadline_keeps_the_block_the_node_took(
    client_factory: Callable[..., Client], cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage has until 3/4 of the call's time; the commit may take longer (an election).
    The node's answers came meanwhile: they are still read, and the put succeeds."""
    monkeypatch.setattr(state_module, "MASTER_ATTEMPT_S", 10.0)  # one slow attempt, no retry
    kv = client_factory(timeout_s=2.0)
    assert kv.put("warm", b"v")
    cluster.master.commit_delay_s = 1.7  # past the stage's deadline (1.5 s), before the call's
    assert kv.put("slow", b"data")
    # The event-loop driver awaits the stage and the commit apart.
    assert async_put(cluster, "aslow", b"data", timeout_s=2.0)
    assert cluster.master.index["slow"].replicas != []
    assert "ReportEvictions" not in cluster.master.calls
    cluster.master.commit_delay_s = 0.0
    assert kv.get("slow") == b"data"


def test_a_put_no_node_took_is_taken_out_of_the_index_again(
    cluster: FakeCluster, client: Client
) -> None:
    cluster.master.report_superseded = True
    assert client.put("old", b"v1")
    for node in cluster.nodes:
        node.no_space = True
    assert not client.put("old", b"v2")  # committed, then refused by the node
    assert not client.put("new", b"v")
    assert "new" not in cluster.master.index
    assert "old" not in cluster.master.index  # the write it replaced was gone from it already
    assert cluster.master.calls["ReportEvictions"] == 2
    # v1, which the index no longer names, was deleted where it was: no read serves it.
    assert not any(key == b"old" for node in cluster.nodes for key, _ in node.blocks)
    assert client.get("old") is None


def test_no_live_replica_fails_the_put(client: Client, cluster: FakeCluster) -> None:
    assert client.put("warm-up", b"1")  # the client now holds a ring with both nodes
    # The index learns both nodes are down; the client's ring (same version) still lists them
    # and the nodes still take bytes, so the commit is what refuses the put.
    cluster.master.down = {1, 2}
    assert client.put("blk", b"data") is False
    assert "blk" not in cluster.master.index
    with pytest.raises(UnavailableError):
        client.put("blk", b"data", strict=True)


def test_stale_ring_refreshes_and_redoes_the_put(client: Client, cluster: FakeCluster) -> None:
    assert client.put("warm-up", b"1")
    cluster.add_node()  # the ring version moves on; the client still has the old ring
    commits_before = cluster.master.calls["CommitPuts"]
    assert client.put("blk", b"data") is True
    commits = [r for m, r in cluster.master.requests if m == "CommitPuts"][commits_before:]
    assert len(commits) == 2
    assert commits[0].request_id != commits[1].request_id
    assert commits[0].entries[0].write_id != commits[1].entries[0].write_id
    assert commits[1].ring_version == cluster.master.ring_version
    assert client.get("blk") == b"data"
    assert client.stats["ring_refreshes"] == 2


def test_no_nodes_fails_the_put(cluster: FakeCluster, client: Client) -> None:
    for node in list(cluster.master.nodes):
        cluster.master.down.add(node)
    assert client.put("blk", b"x") is False
    with pytest.raises(NoNodesError):
        client.put("blk", b"x", strict=True)


# --- placement (pure) -------------------------------------------------------------------------


def _members(*ids: int) -> list[MemberInfo]:
    return [MemberInfo(i, f"node-{i}", f"tcp://127.0.0.1:{7000 + i}", 1 << 30) for i in ids]


def test_placement_refreshes_on_newer_ring_and_node_failure() -> None:
    p = Placement(min_refresh_interval_s=0.5, suspect_s=2.0)
    assert p.needs_refresh()
    with pytest.raises(NoNodesError):
        p.place(b"k", 1)
    assert p.update(_members(1, 2), ring_version=3, now_s=0.0)
    assert not p.needs_refresh()
    assert len(p.place(b"k", 5)) == 2
    p.observe_ring_version(3)
    assert not p.needs_refresh()
    p.observe_ring_version(4)
    assert p.needs_refresh()
    assert not p.update(_members(1), ring_version=2, now_s=1.0)  # older answer: ignored
    assert p.ring_version == 3
    assert p.needs_refresh()  # still behind the version 4 someone reported
    assert p.update(_members(1, 2, 3), ring_version=4, now_s=1.0)
    assert not p.needs_refresh()
    p.node_failed(2, now_s=1.1)  # too soon after the refresh
    assert not p.needs_refresh()
    p.node_failed(2, now_s=1.6)
    assert p.needs_refresh()
    p.mark_stale(5)
    assert p.update(_members(1, 3), ring_version=5, now_s=2.0)
    assert [m.member_id for m in p.members] == [1, 3]


def test_a_failed_node_is_held_back_then_probed_once_per_retry_time() -> None:
    p = Placement(retry_s=1.0)
    p.update(_members(1, 2, 3), ring_version=1, now_s=0.0)
    assert p.sendable(2, now_s=0.0)
    p.node_failed(2, now_s=10.0)
    assert not p.sendable(2, now_s=10.5)
    assert p.sendable(1, now_s=10.5)  # the others are not held
    assert p.sendable(2, now_s=11.0)  # the probe
    assert not p.sendable(2, now_s=11.1)  # one probe per retry time
    assert p.sendable(2, now_s=12.0)
    p.node_answered(2)
    assert p.sendable(2, now_s=12.1)
    assert p.sendable(2, now_s=12.1)
    p.node_failed(3, now_s=20.0)
    p.update(_members(1, 2), ring_version=2, now_s=20.5)  # 3 left: forgotten
    assert p._held == {}
    off = Placement(retry_s=0.0)
    off.update(_members(1), ring_version=1, now_s=0.0)
    off.node_failed(1, now_s=1.0)
    assert off.sendable(1, now_s=1.0)


@pytest.mark.parametrize("retry_s", [1.0, 0.0])
def test_failures_of_members_long_gone_are_forgotten(retry_s: float) -> None:
    # A long-lived client sees member ids come and go (every restart is a new incarnation):
    # what it remembers of their failures stays bounded, whether holds are on or off.
    p = Placement(suspect_s=2.0, retry_s=retry_s)
    p.update(_members(1, 2), ring_version=1, now_s=0.0)
    for i in range(1000):
        p.node_failed(100 + i, now_s=10.0 * i)
    assert len(p._suspect_until) <= 4 * 16 + 1
    p.update(_members(1, 2), ring_version=2, now_s=1e5)
    assert p.held == {}


def test_puts_go_around_a_held_node_unless_none_is_left() -> None:
    p = Placement(retry_s=1.0)
    p.update(_members(1, 2, 3), ring_version=1, now_s=0.0)
    key = next(k for k in (f"k{i}".encode() for i in range(100)) if p.place(k, 1)[0].member_id == 2)
    ring = [m.member_id for m in p.place(key, 3)]
    assert [m.member_id for m in p.targets(key, 2, now_s=0.0)] == ring[:2]
    p.node_failed(2, now_s=10.0)
    assert [m.member_id for m in p.targets(key, 1, now_s=10.2)] == [ring[1]]
    assert [m.member_id for m in p.targets(key, 2, now_s=10.2)] == ring[1:]
    assert p.place(key, 1)[0].member_id == 2  # reads by content still look where the ring says
    # Its retry time up, the first put placed there is the probe; the next goes around again.
    assert [m.member_id for m in p.targets(key, 1, now_s=11.0)] == [2]
    assert [m.member_id for m in p.targets(key, 1, now_s=11.1)] == [ring[1]]
    for m in (1, 3):
        p.node_failed(m, now_s=11.2)
    # Every node held: the put still goes where the ring says (better tried than refused).
    assert [m.member_id for m in p.targets(key, 1, now_s=11.3)] == [2]


def test_read_order_rotates_and_puts_suspects_last() -> None:
    p = Placement(suspect_s=2.0)
    p.update(_members(1, 2, 3), ring_version=1, now_s=0.0)
    assert p.read_order([1, 2, 3], now_s=0.0, start=1) == [2, 3, 1]
    p.node_failed(2, now_s=10.0)
    assert p.read_order([1, 2, 3], now_s=10.5, start=1) == [3, 1, 2]
    assert p.read_order([1, 2, 3], now_s=12.5, start=1) == [2, 3, 1]  # suspicion expired
    assert p.read_order([], now_s=0.0, start=3) == []


# --- unreachable masters ----------------------------------------------------------------------


def test_unreachable_masters_fail_within_the_deadline() -> None:
    with blackhole() as silent_master:
        start = time.monotonic()
        kv = Client([f"127.0.0.1:{free_port()}", silent_master], timeout_s=0.5)
        assert time.monotonic() - start < 0.2  # the constructor does not dial
        try:
            start = time.monotonic()
            report = kv.warm_up()
            assert time.monotonic() - start < 0.5 + 0.3
            assert report.masters
            assert not report.ok
            assert report.nodes == {}
            assert report.summary().startswith("no master answered")
            for call in (
                lambda: kv.put("k", b"v"),
                lambda: kv.get("k"),
                lambda: kv.exists("k"),
                lambda: kv.remove("k"),
                lambda: kv.prefix_match(["k"]),
                lambda: kv.batch_get(["k", "l"]),
                lambda: kv.batch_put({"k": b"v"}),
            ):
                start = time.monotonic()
                result = call()
                assert time.monotonic() - start < 0.5 + 0.3
                assert not any(result) if isinstance(result, list) else not result
            start = time.monotonic()
            with pytest.raises((UnavailableError, DeadlineExceededError)):
                kv.get("k", strict=True)
            with pytest.raises((UnavailableError, DeadlineExceededError)):
                kv.put("k", b"v", strict=True)
            assert time.monotonic() - start < 2 * (0.5 + 0.3)
            assert kv.stats["puts_failed"] == 3
            assert kv.get_or_compute("k", lambda: b"computed") == b"computed"
        finally:
            kv.close()


def test_strict_client_raises_for_whole_call_failures() -> None:
    with Client(f"127.0.0.1:{free_port()}", timeout_s=0.3, strict=True) as kv:
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            kv.exists("k")
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            kv.batch_get(["k"])
        assert kv.get("k", strict=False) is None


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_BYTES + 1), "\u00e9" * 513, 7, b"k", None])
def test_bad_keys_raise_in_every_mode(client: Client, key: Any) -> None:
    with pytest.raises(InvalidKeyError):
        client.put(key, b"v")
    with pytest.raises(InvalidKeyError):
        client.get(key)
    with pytest.raises(InvalidKeyError):
        client.exists(key)
    with pytest.raises(InvalidKeyError):
        client.batch_get(["ok", key])
    with pytest.raises(InvalidKeyError):
        client.get_or_compute(key, lambda: b"v")


def test_longest_key_is_accepted(client: Client) -> None:
    key = "k" * MAX_KEY_BYTES
    assert client.put(key, b"v")
    assert client.get(key) == b"v"


@pytest.mark.parametrize(
    "value",
    [
        "a str",
        [1, 2],
        12,
        None,
        memoryview(b"abcdef")[::2],
        np.arange(16).reshape(4, 4)[:, 1],
        np.array([object()]),
    ],
    ids=["str", "list", "int", "none", "strided-view", "strided-array", "object-array"],
)
def test_bad_values_raise_in_every_mode(client: Client, cluster: FakeCluster, value: Any) -> None:
    with pytest.raises(InvalidValueError):
        client.put("k", value)
    with pytest.raises(InvalidValueError):
        client.batch_put({"ok": b"1", "k": value})
    assert "ok" not in cluster.master.index  # nothing of a bad batch is stored


def test_too_large_value_raises(client_factory: Callable[..., Client]) -> None:
    kv = client_factory(max_value_size=1024)
    assert kv.put("k", b"x" * 1024)
    with pytest.raises(ValueTooLargeError):
        kv.put("k", b"x" * 1025)
    with pytest.raises(ValueTooLargeError):
        kv.get_or_compute("other", lambda: np.zeros(1025, dtype=np.uint8))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"masters": []}, "masters"),
        ({"masters": "nohost"}, "masters"),
        ({"masters": ["127.0.0.1:99999"]}, "masters"),
        ({"masters": [7]}, "masters"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "2"}, "timeout_s"),
        ({"replicas": 0}, "replicas"),
        ({"max_value_size": -1}, "max_value_size"),
        ({"connections_per_node": 0}, "connections_per_node"),
        ({"strict": "yes"}, "strict"),
    ],
)
def test_bad_configuration_raises_config_error(kwargs: dict[str, Any], name: str) -> None:
    args = {"masters": ["127.0.0.1:7300"], **kwargs}
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=name):
        Client(**args)
    assert not threads_started_since(before)


def test_masters_as_comma_separated_string() -> None:
    config = make_config(" 127.0.0.1:1, 127.0.0.1:2 ,")
    assert config.masters == ("127.0.0.1:1", "127.0.0.1:2")


# --- get_into ---------------------------------------------------------------------------------


def test_get_into_fills_the_callers_buffer(client: Client) -> None:
    arr = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    assert client.put("t", arr)
    out = np.empty_like(arr)
    assert client.get_into("t", out) == arr.nbytes
    assert np.array_equal(out, arr)
    big = bytearray(arr.nbytes + 100)
    assert client.get_into("t", big) == arr.nbytes
    assert bytes(big[: arr.nbytes]) == arr.tobytes()
    assert client.get_into("absent", big) is None


def test_get_into_refuses_small_readonly_and_strided_buffers(client: Client) -> None:
    assert client.put("t", b"x" * 100)
    with pytest.raises(BufferTooSmallError):
        client.get_into("t", bytearray(99))
    with pytest.raises(BufferTooSmallError):
        client.get_into("t", bytearray(99), strict=True)
    with pytest.raises(InvalidValueError):
        client.get_into("t", b"\x00" * 200)  # read-only
    with pytest.raises(InvalidValueError):
        client.get_into("t", memoryview(bytearray(400))[::2])
    with pytest.raises(InvalidValueError):
        client.get_into("t", "not a buffer")  # type: ignore[arg-type]


# --- get_or_compute ---------------------------------------------------------------------------


def test_get_or_compute_computes_once(client: Client) -> None:
    calls = []

    def compute() -> bytes:
        calls.append(1)
        return b"expensive prefill"

    assert client.get_or_compute("prefix", compute) == b"expensive prefill"
    assert client.get_or_compute("prefix", compute) == b"expensive prefill"
    assert len(calls) == 1
    assert client.stats["fallbacks"] == 1
    arr = np.arange(10, dtype=np.int64)
    assert client.get_or_compute("arr", lambda: arr) == arr.tobytes()


def test_get_or_compute_propagates_fn_errors_and_survives_store_failures(
    client: Client, cluster: FakeCluster
) -> None:
    def boom() -> bytes:
        raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        client.get_or_compute("k", boom)
    for node in cluster.nodes:
        node.no_space = True
    assert client.get_or_compute("k", lambda: b"v") == b"v"
    assert client.stats["puts_failed"] == 1


# --- lifecycle and threads --------------------------------------------------------------------


def test_close_is_idempotent_and_the_client_runs_no_thread_of_its_own(
    cluster: FakeCluster,
) -> None:
    before = set(threading.enumerate())
    kv = Client([cluster.master_address], timeout_s=1.0)
    # Every call runs in the caller's thread: no event-loop thread, no helper threads.
    assert kv.put("k", b"v")
    assert kv.get("k") == b"v"
    assert (kv.exists("k"), kv.exists("absent")) == (True, False)
    assert (kv.sizes(["k"]), kv.prefix_match(["k", "absent"])) == ([1], 1)
    assert not threads_started_since(before)
    kv.close()
    kv.close()
    assert kv.closed
    for call in (lambda: kv.get("k"), lambda: kv.exists("k"), lambda: kv.pin(["k"])):
        with pytest.raises(UnavailableError):
            call()
    with Client([cluster.master_address]) as kv2:
        assert kv2.get("k") == b"v"
    assert kv2.closed
    assert not threads_started_since(before)


def test_a_client_dropped_without_close_is_collected_and_closes_its_connections(
    cluster: FakeCluster,
) -> None:
    kv = Client([cluster.master_address], timeout_s=2.0)
    assert kv.put("dropped", b"v")
    conns = kv._data._conns
    assert len(conns) >= 1
    alive = weakref.ref(kv)
    del kv
    gc.collect()
    assert alive() is None  # nothing the client made holds the client
    assert len(conns) == 0  # closed, every one
    assert conns._closed


def test_many_threads_share_one_client(client: Client) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(20):
                key = f"t{t}/{i}"
                value = f"{t}:{i}".encode() * 50
                assert client.put(key, value)
                assert client.get(key) == value
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors
    assert client.stats["hits"] == 160


# --- the async core directly ------------------------------------------------------------------


def test_core_runs_on_any_event_loop(cluster: FakeCluster) -> None:
    async def main() -> None:
        config = make_config([cluster.master_address], timeout_s=1.0)
        core = ClientCore(config)
        try:
            assert await core.put("a", b"async")
            assert await core.get("a") == b"async"
            assert await core.get_or_compute("b", _async_value) == b"from a coroutine"
            assert await core.batch_get(["a", "b", "c"]) == [b"async", b"from a coroutine", None]
        finally:
            await core.close()
        assert core.closed
        with pytest.raises(UnavailableError):
            await core.get("a")

    asyncio.run(main())


def test_the_async_core_has_the_sync_clients_index_and_batch_calls(cluster: FakeCluster) -> None:
    async def main() -> None:
        core = ClientCore(make_config([cluster.master_address], timeout_s=2.0))
        try:
            assert await core.batch_put({"x/1": b"a", "x/2": b"bb"}) == [True, True]
            # The fake answers PrefixMatch with a count only, as an older master: a Lookup.
            assert await core.batch_exists(["x/1", "nope", "x/2"]) == [True, False, True]
            where = await core.locate(["x/2", "nope"])
            assert where[0] is not None
            assert where[1] is None
            assert (where[0].key, where[0].size_bytes) == ("x/2", 2)
            made = await core.batch_get_alloc(["x/1", "nope"], bytearray)
            assert made == [bytearray(b"a"), None]
            assert await core.batch_remove(["x/1", "nope"]) == [True, False]
            assert await core.sizes(["x/1", "x/2"]) == [None, 2]
        finally:
            await core.close()

    asyncio.run(main())


async def _async_value() -> bytes:
    return b"from a coroutine"


def test_cancelled_get_into_never_writes_the_buffer_afterwards(cluster: FakeCluster) -> None:
    size = 48 << 20

    async def main() -> None:
        core = ClientCore(make_config([cluster.master_address], timeout_s=5.0))
        try:
            assert await core.put("big", b"\xab" * size)
            buf = bytearray(size)
            task = asyncio.create_task(core.get_into("big", buf))
            # Poll the buffer itself: the first bytes have landed, the rest are on their way.
            while buf[0] == 0:  # noqa: ASYNC110
                await asyncio.sleep(0)
            assert buf[-1] == 0
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            buf[:] = b"\x00" * size
            await asyncio.sleep(0.2)
            assert not any(buf)
            # The connection was cut; the next read opens a fresh one and works.
            assert await core.get_into("big", buf) == size
        finally:
            await core.close()

    asyncio.run(main())


def test_an_empty_ring_is_asked_again() -> None:
    """Right after a cluster starts a follower may answer GetMembers before it applied the
    nodes' registrations: a put must not fail on that empty ring while the leader has nodes."""
    p = Placement(min_refresh_interval_s=0.5, suspect_s=2.0)
    assert not p.ring_is_empty()  # nothing loaded yet
    assert p.update([], ring_version=1, now_s=0.0)
    assert p.ring_is_empty()
    with pytest.raises(NoNodesError):
        p.place(b"k", 1)
    assert p.needs_refresh()
    assert p.update(_members(1), ring_version=2, now_s=0.1)
    assert not p.needs_refresh()
    assert not p.ring_is_empty()
    assert [m.member_id for m in p.place(b"k", 1)] == [1]
    draining = [MemberInfo(1, "node-1", "tcp://127.0.0.1:7001", 1 << 30, draining=True)]
    assert p.update(draining, ring_version=3, now_s=0.2)  # no node takes puts: ask again
    assert p.needs_refresh()
    assert p.ring_is_empty()


# --- tracing --------------------------------------------------------------------------------------


def test_a_traced_batch_read_from_two_nodes_has_a_span_per_node_under_the_calls(
    client: Client,
) -> None:
    keys = [f"traced/{i}" for i in range(16)]
    assert all(client.batch_put([(k, k.encode() * 64) for k in keys]))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = (tracing.STATE.enabled, tracing.STATE.tracer)
    tracing.STATE.tracer, tracing.STATE.enabled = provider.get_tracer("test"), True
    try:
        assert client.batch_get(keys) == [k.encode() * 64 for k in keys]
    finally:
        tracing.STATE.enabled, tracing.STATE.tracer = saved
        provider.shutdown()
    spans = exporter.get_finished_spans()
    (call,) = [s for s in spans if s.name == "kvpool.batch_get"]
    per_node = [s for s in spans if s.name == "kvpool.client.read"]
    nodes = {dict(s.attributes or {})["kvpool.node"] for s in per_node}
    assert len(per_node) == 2, "one span per node the round read from"
    assert len(nodes) == 2
    counts = [c for s in per_node if isinstance(c := dict(s.attributes or {})["kvpool.keys"], int)]
    assert len(counts) == 2
    assert min(counts) > 0
    assert sum(counts) == len(keys)
    for span in per_node:
        assert span.parent is not None
        assert span.parent.span_id == call.context.span_id
