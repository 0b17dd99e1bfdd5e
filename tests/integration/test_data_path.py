"""The fast paths against real processes: the masters' frame RPC port, and the client over TCP
and over a same-host node's shared memory."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import Client
from kvpool.errors import NotLeaderError
from kvpool.grpcutil import PROTOCOL_METADATA
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import master_pb2, master_pb2_grpc
from kvpool.proto.wire import Op, Status
from kvpool.transports import open_blocking
from kvpool.transports.calls import Call
from kvpool.transports.shm import ShmBlockingConnection, shm_supported

pytestmark = pytest.mark.integration
MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        Path(tmp_path_factory.mktemp("data-path")), masters=3, nodes=2, cpu_cache_size="256MiB"
    )
    try:
        c.start()
        yield c
    finally:
        c.stop()


def members_of(address: str) -> master_pb2.GetMembersResponse:
    with grpc.insecure_channel(address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        response: master_pb2.GetMembersResponse = stub.GetMembers(
            master_pb2.GetMembersRequest(), timeout=5, metadata=PROTOCOL_METADATA
        )
        return response


def rpc(address: str, method: str, request: bytes) -> Call:
    conn = open_blocking(f"tcp://{address}", 5.0)
    try:
        call = Call(Op.RPC, method.encode(), version=2_000_000, payload=request)
        conn.exchange([call], time.monotonic() + 5)
        ping = Call(Op.PING)
        conn.exchange([ping], time.monotonic() + 5)  # the connection survives any answer
        assert ping.status == Status.OK
        return call
    finally:
        conn.close()


def test_every_master_offers_its_rpc_port_and_answers_as_over_grpc(cluster: LocalCluster) -> None:
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert kv.put("rpc/k", b"v" * 1000)
    # A follower names the leader once it has heard from it: on a loaded machine an election
    # may still be settling (a follower then answers "no leader known yet"), so ask again.
    deadline = time.monotonic() + 15.0
    while True:
        unsettled = _rpc_port_answers(cluster)
        if unsettled is None:
            break
        assert time.monotonic() < deadline, unsettled
        time.sleep(0.2)
    leader = cluster.processes[cluster.leader_name()].grpc
    unknown = rpc(members_of(leader).rpc_address, "RegisterNode", b"")
    assert unknown.status == Status.BAD_REQUEST
    assert NotLeaderError.code == "NOT_LEADER"


def _rpc_port_answers(cluster: LocalCluster) -> str | None:
    """Check every master's frame RPC port once: None when all answered as they must, or why a
    follower could not name the leader yet (asserting on any other wrong answer)."""
    leader = cluster.processes[cluster.leader_name()].grpc
    for address in cluster.master_addresses:
        offered = members_of(address).rpc_address
        assert offered
        lookup = master_pb2.LookupRequest(keys=["rpc/k", "rpc/absent"])
        call = rpc(offered, "Lookup", lookup.SerializeToString())
        if address == leader:
            if call.status != Status.OK:
                return f"the leader {leader} refused a Lookup: {bytes(call.data or b'')!r}"
            answer = master_pb2.LookupResponse.FromString(bytes(call.data or b""))
            assert [e.found for e in answer.entries] == [True, False]
            assert answer.entries[0].size_bytes == 1000
            continue
        # a lookup or a write on a follower: the typed error, naming the leader
        commit = master_pb2.CommitPutsRequest(
            request_id=os.urandom(16),
            ring_version=1,
            entries=[master_pb2.PutEntry(key="x", write_id=1, size_bytes=1, replicas=[1])],
        )
        for refused in (call, rpc(offered, "CommitPuts", commit.SerializeToString())):
            assert refused.status == Status.RPC_ERROR
            data = bytes(refused.data or b"")
            assert b"NOT_LEADER" in data
            if leader.encode() not in data:
                return f"follower {address} answered {data!r}, not naming the leader {leader}"
    return None


NEEDS_SHM = pytest.mark.skipif(not shm_supported(), reason="shared memory needs Linux")


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_the_client_over_tcp_and_shared_memory(cluster: LocalCluster, transport: str) -> None:
    blocks = {f"{transport}/{n}": os.urandom(n) for n in (1, 4096, 70_000, 2 * MIB)}
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        assert kv.batch_put(blocks) == [True] * len(blocks)
        assert kv.batch_get(list(blocks)) == list(blocks.values())
        for key, value in blocks.items():
            buf = bytearray(len(value))
            assert kv.get_into(key, buf) == len(value)
            assert buf == value
        conns = list(kv._data._conns().values())
        assert conns
        assert all(isinstance(c, ShmBlockingConnection) == (transport == "shm") for c in conns)
    with Client(cluster.master_addresses, timeout_s=5.0, transport="tcp") as other:
        assert other.batch_get(list(blocks)) == list(blocks.values())  # the same blocks
