"""End to end on a real local cluster (3 masters, 2 store nodes): what a user of the cache sees."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from kvpool import Client
from kvpool.checksum import block_checksum
from kvpool.errors import (
    BufferTooSmallError,
    InvalidKeyError,
    InvalidValueError,
    MalformedRequestError,
    ProtocolVersionError,
    ValueTooLargeError,
)
from kvpool.grpcutil import create_channel, translate_rpc_error, unary
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.v1 import master_pb2, master_pb2_grpc
from kvpool.proto.wire import MAX_KEY_BYTES, Header, Op, Status, unpack_header
from kvpool.transports.tcp import TcpConnection, parse_tcp_address
from tests.integration.conftest import ClusterFactory

pytestmark = pytest.mark.integration


def test_a_thousand_blocks_of_mixed_sizes_read_back_byte_for_byte(
    shared_cluster: LocalCluster,
) -> None:
    rng = np.random.default_rng(1)
    # Log-uniform sizes from 1 B to 4 MiB, both ends included.
    sizes = np.exp(rng.uniform(0, np.log(4 << 20), size=1000)).astype(int)
    sizes[0], sizes[1] = 1, 4 << 20
    values = {f"mixed/{i}": rng.bytes(int(n)) for i, n in enumerate(sizes)}
    with Client(shared_cluster.master_addresses, timeout_s=10.0) as kv:
        items = list(values.items())
        for start in range(0, len(items), 50):
            assert all(kv.batch_put(items[start : start + 50]))
        for key, value in values.items():
            assert kv.get(key) == value, key
        keys = list(values)
        got = kv.batch_get(keys[:200])
        assert got == [values[k] for k in keys[:200]]


def test_value_types_and_get_into(shared_cluster: LocalCluster) -> None:
    array = np.arange(1000, dtype=np.float32)
    with Client(shared_cluster.master_addresses) as kv:
        assert kv.put("types/bytes", b"abc")
        assert kv.put("types/bytearray", bytearray(b"defg"))
        assert kv.put("types/memoryview", memoryview(b"hijkl"))
        assert kv.put("types/numpy", array)
        assert kv.get("types/bytes") == b"abc"
        assert kv.get("types/bytearray") == b"defg"
        assert kv.get("types/memoryview") == b"hijkl"
        out = np.empty(1000, dtype=np.float32)
        assert kv.get_into("types/numpy", out) == array.nbytes
        np.testing.assert_array_equal(out, array)
        with pytest.raises(BufferTooSmallError):
            kv.get_into("types/numpy", bytearray(10))
        assert kv.get_into("types/absent", bytearray(10)) is None


def test_exists_remove_prefix_match_and_get_or_compute(shared_cluster: LocalCluster) -> None:
    with Client(shared_cluster.master_addresses) as kv:
        chain = [f"chain/{i}" for i in range(8)]
        assert all(kv.batch_put([(k, k.encode() * 100) for k in chain[:5]]))
        assert kv.prefix_match(chain) == 5
        assert kv.exists("chain/0")
        assert kv.remove("chain/2")
        assert not kv.exists("chain/2")
        assert kv.get("chain/2") is None
        assert kv.prefix_match(chain) == 2
        assert kv.prefix_match(chain, fetch_entries=False) == 2
        assert kv.batch_exists(chain) == [True, True, False, True, True, False, False, False]
        assert not kv.remove("chain/2")

        calls = []

        def compute() -> bytes:
            calls.append(1)
            return b"computed"

        assert kv.get_or_compute("goc/1", compute) == b"computed"
        assert kv.get_or_compute("goc/1", compute) == b"computed"
        assert len(calls) == 1  # the second call was a hit


def test_concurrent_puts_of_one_key_are_read_whole(shared_cluster: LocalCluster) -> None:
    """4 writers put distinct 256 KiB values to one key while a reader reads it: every read is
    exactly one writer's value, never a mix, never garbage."""
    key = "contended/key"
    size = 256 * 1024
    values = {w: bytes([w + 1]) * size for w in range(4)}
    stop = threading.Event()
    reads: list[bytes | None] = []
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            with Client(shared_cluster.master_addresses) as kv:
                for _ in range(15):
                    kv.put(key, values[w])
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)

    def reader() -> None:
        with Client(shared_cluster.master_addresses) as kv:
            while not stop.is_set():
                reads.append(kv.get(key))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    r.join(30)
    assert not errors
    seen = [v for v in reads if v is not None]
    assert seen, "the reader never saw a value"
    allowed = set(values.values())
    assert all(v in allowed for v in seen), "a read returned bytes no single put wrote"
    with Client(shared_cluster.master_addresses) as kv:
        assert kv.get(key) in allowed


def test_bad_keys_and_values_raise_typed_errors(shared_cluster: LocalCluster) -> None:
    with Client(shared_cluster.master_addresses, max_value_size=1 << 20) as kv:
        with pytest.raises(InvalidKeyError):
            kv.put("", b"x")
        with pytest.raises(InvalidKeyError):
            kv.put("k" * (MAX_KEY_BYTES + 1), b"x")
        with pytest.raises(InvalidKeyError):
            kv.get(123)  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError):
            kv.put("k", "a str is not bytes")  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError):
            kv.put("k", np.arange(10)[::2])  # not contiguous
        with pytest.raises(ValueTooLargeError):
            kv.put("k", bytes((1 << 20) + 1))
        # The cluster still serves after all that.
        assert kv.put("after-bad-input", b"fine")
        assert kv.get("after-bad-input") == b"fine"


def test_unreachable_masters_fail_within_the_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    t = time.monotonic()
    with Client([dead], timeout_s=0.5) as kv:
        assert kv.get("x") is None
        assert kv.put("x", b"y") is False
    assert time.monotonic() - t < 3.0


def _node_data_address(cluster: LocalCluster) -> tuple[str, int]:
    address = cluster.nodes[0].data.removeprefix("tcp://")
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _read_frame(sock: socket.socket) -> tuple[Header, bytes]:
    buf = b""
    while len(buf) < 56:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    header = unpack_header(buf[:56])
    rest = buf[56:]
    while len(rest) < header.key_len + header.payload_len:
        chunk = sock.recv(4096)
        if not chunk:
            break
        rest += chunk
    return header, rest[header.key_len : header.key_len + header.payload_len]


def test_garbage_on_the_data_port_is_refused_and_nothing_is_lost(
    shared_cluster: LocalCluster,
) -> None:
    with Client(shared_cluster.master_addresses) as kv:
        keys = [f"garbage-test/{i}" for i in range(20)]
        assert all(kv.batch_put([(k, k.encode() * 1000) for k in keys]))
        for node in shared_cluster.nodes:
            host, port = node.data.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: kvpool\r\n\r\n" + os.urandom(200))
                header, body = _read_frame(s)
                assert header.status == Status.BAD_REQUEST
                assert b"magic" in body
        assert kv.batch_get(keys) == [k.encode() * 1000 for k in keys]


def test_data_plane_peer_with_another_protocol_version_is_refused(
    shared_cluster: LocalCluster,
) -> None:
    host, port = _node_data_address(shared_cluster)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(Header(op=Op.PING, protocol_version=PROTOCOL_VERSION + 41).pack())
        header, body = _read_frame(s)
    assert header.status == Status.VERSION_MISMATCH
    text = body.decode()
    assert str(PROTOCOL_VERSION) in text
    assert str(PROTOCOL_VERSION + 41) in text


def test_grpc_caller_with_another_protocol_version_is_refused(
    shared_cluster: LocalCluster,
) -> None:
    async def call() -> Exception | None:
        channel = create_channel(shared_cluster.master_addresses[0])
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            try:
                await stub.GetMembers(
                    master_pb2.GetMembersRequest(),
                    timeout=5,
                    metadata=(("kvpool-protocol-version", "999"),),
                )
            except grpc.aio.AioRpcError as e:
                return translate_rpc_error(e, "master")
            return None
        finally:
            await channel.close()

    error = asyncio.run(call())
    assert isinstance(error, ProtocolVersionError)
    message = error.message
    assert "999" in message
    assert str(PROTOCOL_VERSION) in message


def test_node_with_another_protocol_version_cannot_register(
    shared_cluster: LocalCluster,
) -> None:
    async def register() -> str:
        channel = create_channel(shared_cluster.master_addresses[0])
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            request = master_pb2.RegisterNodeRequest(
                request_id=os.urandom(16),
                node_id="impostor",
                incarnation=1,
                data_address="tcp://127.0.0.1:1",
                admin_address="127.0.0.1:1",
                capacity_bytes=1 << 30,
            )
            try:
                await stub.RegisterNode(
                    request, timeout=5, metadata=(("kvpool-protocol-version", "0"),)
                )
            except Exception as e:
                return str(e.details())  # type: ignore[attr-defined]
            return ""
        finally:
            await channel.close()

    message = asyncio.run(register())
    assert "speaks 0" in message
    assert f"protocol {PROTOCOL_VERSION}" in message


def test_malformed_grpc_requests_get_typed_errors_and_the_master_keeps_serving(
    shared_cluster: LocalCluster,
) -> None:
    leader = shared_cluster.wait_for_leader()

    async def calls() -> None:
        channel = create_channel(leader)
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            bad_requests = [
                (stub.CommitPuts, master_pb2.CommitPutsRequest(request_id=b"abc")),
                (
                    stub.CommitPuts,
                    master_pb2.CommitPutsRequest(
                        request_id=os.urandom(16),
                        entries=[master_pb2.PutEntry(key="", write_id=1, replicas=[1])],
                    ),
                ),
                (stub.Lookup, master_pb2.LookupRequest(keys=["x" * (MAX_KEY_BYTES + 10)])),
                (stub.Remove, master_pb2.RemoveRequest(request_id=b"", keys=["a"])),
            ]
            for method, request in bad_requests:
                with pytest.raises((MalformedRequestError, InvalidKeyError)):
                    await unary(method, request, timeout_s=5, address=leader)
            # Not even protobuf: raw garbage bytes as the request body.
            raw = channel.unary_unary("/kvpool.v1.Master/Lookup")
            with pytest.raises(Exception, match=r"(?i)pars|deserial|invalid"):
                await raw(
                    b"\xff\xff\xff\xff garbage",
                    timeout=5,
                    metadata=(("kvpool-protocol-version", str(PROTOCOL_VERSION)),),
                )
            members = await unary(
                stub.GetMembers, master_pb2.GetMembersRequest(), timeout_s=5, address=leader
            )
            assert len(members.members) == 2
        finally:
            await channel.close()

    asyncio.run(calls())
    with Client(shared_cluster.master_addresses) as kv:
        assert kv.put("after-malformed", b"ok")
        assert kv.get("after-malformed") == b"ok"


def test_a_stale_index_answer_can_only_cause_a_miss(shared_cluster: LocalCluster) -> None:
    """A master that has not applied the latest put (a deposed leader, a lagging follower)
    hands out the previous write id: the node refuses it, never serving other bytes."""

    # The leader applied each put before acknowledging it (a follower may not have yet).
    leader = shared_cluster.wait_for_leader()

    async def lookup(key: str) -> tuple[int, int, str]:
        address = leader
        channel = create_channel(address)
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            response = await unary(
                stub.Lookup, master_pb2.LookupRequest(keys=[key]), timeout_s=5, address=address
            )
        finally:
            await channel.close()
        entry = response.entries[0]
        members = {m.member_id: m.data_address for m in response.members}
        return entry.write_id, entry.size_bytes, members[entry.replicas[0]]

    async def read(address: str, key: str, write_id: int, size: int) -> tuple[int, bytes]:
        host, port = parse_tcp_address(address)
        conn = await TcpConnection.open(host, port, timeout_s=5)
        try:
            sink = memoryview(bytearray(size))
            response = await conn.request(
                Op.GET, key.encode(), write_id=write_id, sink=sink, timeout_s=5
            )
            return response.status, bytes(sink)
        finally:
            conn.close()

    key = "stale/answer"
    with Client(shared_cluster.master_addresses) as kv:
        assert kv.put(key, b"old!" * 1000)
        old_write_id, size, address = asyncio.run(lookup(key))
        assert asyncio.run(read(address, key, old_write_id, size)) == (Status.OK, b"old!" * 1000)
        assert kv.put(key, b"new!" * 1000)
        status, _ = asyncio.run(read(address, key, old_write_id, size))
        assert status == Status.MISS
        assert kv.get(key) == b"new!" * 1000


def test_a_commit_whose_bytes_never_came_leaves_the_index_after_the_staged_ttl(
    cluster_factory: ClusterFactory,
) -> None:
    """A put commits while its bytes are on their way; a client that dies in between leaves
    the index naming a block its node never received. Reads miss it (never a wrong block);
    the node, asked for it, checks the index once ``staged_ttl_s`` has passed and reports it
    gone, so that ``exists`` and ``prefix_match`` stop counting it."""
    cluster = cluster_factory(
        masters=3,
        nodes=1,
        extra_node_flags=["--staged-ttl-s", "0.5", "--eviction-report-interval-s", "0.05"],
    )
    leader = cluster.wait_for_leader()
    data = b"never sent" * 100

    async def commit_only(key: str) -> None:
        """What the dead client got done: the commit, and no byte to the node."""
        channel = create_channel(leader)
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            members = await unary(
                stub.GetMembers, master_pb2.GetMembersRequest(), timeout_s=5, address=leader
            )
            entry = master_pb2.PutEntry(
                key=key,
                write_id=int.from_bytes(os.urandom(8), "little") | 1,
                size_bytes=len(data),
                checksum=block_checksum(data),
                replicas=[members.members[0].member_id],
            )
            request = master_pb2.CommitPutsRequest(
                request_id=os.urandom(16), ring_version=members.ring_version, entries=[entry]
            )
            response = await unary(stub.CommitPuts, request, timeout_s=5, address=leader)
            assert response.results[0].status == master_pb2.PUT_STATUS_COMMITTED
        finally:
            await channel.close()

    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert kv.put("kept", data)
        asyncio.run(commit_only("phantom"))
        assert kv.exists("phantom")  # the index names it...
        assert kv.get("phantom") is None  # ...its node never had it: a miss
        deadline = time.monotonic() + 15
        while kv.exists("phantom") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not kv.exists("phantom")
        assert kv.prefix_match(["phantom"]) == 0
        assert kv.get("kept") == data  # what was put and read is untouched
        assert kv.exists("kept")
