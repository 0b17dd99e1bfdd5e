"""The fast paths against real processes: the masters' frame RPC port, and the client over TCP
and over a same-host node's shared memory."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import AsyncClient, Client
from kvpool.client import links as client_links
from kvpool.errors import NotLeaderError
from kvpool.grpcutil import PROTOCOL_METADATA
from kvpool.keys import KeyNamespace, block_keys
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import master_pb2, master_pb2_grpc
from kvpool.proto.wire import Op, Status
from kvpool.transports import open_blocking
from kvpool.transports import shm as shm_transport
from kvpool.transports.blocking import BlockingConnection
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
    # Its read port answers the same reads, from threads, and no writes.
    read_port = members_of(leader).read_address
    assert read_port
    assert read_port != members_of(leader).rpc_address
    lookup = master_pb2.LookupRequest(keys=["rpc/k", "rpc/absent"])
    read = rpc(read_port, "Lookup", lookup.SerializeToString())
    assert read.status == Status.OK
    found = master_pb2.LookupResponse.FromString(bytes(read.data or b"")).entries
    assert [e.found for e in found] == [True, False]
    assert rpc(read_port, "CommitPuts", b"").status == Status.BAD_REQUEST
    # A read the leader cannot answer as it is (behind the caller) waits, then says so.
    ahead = master_pb2.LookupRequest(keys=["rpc/k"], min_revision=1 << 50)
    started = time.monotonic()
    lagging = rpc(members_of(leader).rpc_address, "Lookup", ahead.SerializeToString())
    assert lagging.status == Status.RPC_ERROR
    assert b"NOT_CAUGHT_UP" in bytes(lagging.data or b"")
    assert time.monotonic() - started >= 0.9  # MAX_REVISION_WAIT_S, as over gRPC


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
    sizes = (1, 4096, 70_000, 2 * MIB, 5 * MIB + 3)  # the last copied in two halves over shm
    blocks = {f"{transport}/{n}": os.urandom(n) for n in sizes}
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        assert kv.batch_put(blocks) == [True] * len(blocks)
        assert kv.batch_get(list(blocks)) == list(blocks.values())
        for key, value in blocks.items():
            buf = bytearray(len(value))
            assert kv.get_into(key, buf) == len(value)
            assert buf == value
        conns = list(kv._data._conns.of_this_thread().values())
        assert conns
        assert all(isinstance(c, ShmBlockingConnection) == (transport == "shm") for c in conns)
    with Client(cluster.master_addresses, timeout_s=5.0, transport="tcp") as other:
        assert other.batch_get(list(blocks)) == list(blocks.values())  # the same blocks


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_a_get_makes_one_copy_of_the_block_in_new_memory(
    cluster: LocalCluster, transport: str
) -> None:
    """``get`` returns the bytes object the block was received (tcp) or copied (shm) into: one
    block's size of new memory, not a buffer and then its copy (two 4 MiB allocations alive at
    once also made glibc give the heap back and fault it in again on every call: a 4 MiB shm
    ``get`` took 3.3 ms against 0.6 ms for ``get_into``)."""
    value = os.urandom(4 * MIB)
    key = f"one-copy/{transport}"
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        assert kv.put(key, value)
        assert kv.get(key) == value  # connections open, entry cached
        tracemalloc.start()
        try:
            got = kv.get(key)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got == value
        assert type(got) is bytes
        assert peak < len(value) + MIB // 2, f"{peak} bytes allocated for a {len(value)} B get"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_a_thread_per_request_reuses_the_connections_of_threads_that_ended(
    cluster: LocalCluster, transport: str
) -> None:
    """An engine that starts a thread per request: the connections of ended threads serve the
    next ones (no descriptor or node connection left behind per thread), a few at once too."""
    blocks = {f"per-thread/{transport}/{i}": os.urandom(8192 + i) for i in range(8)}
    without = open_fds()
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        assert kv.batch_put(blocks) == [True] * len(blocks)
        wrong: list[str] = []

        def request(key: str) -> None:
            if kv.get(key) != blocks[key]:
                wrong.append(key)

        def wave(keys: list[str]) -> None:
            threads = [threading.Thread(target=request, args=(key,)) for key in keys]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)

        for _ in range(10):  # 40 threads, four at a time
            wave(list(blocks)[4:])
        assert wrong == []
        # What is open: this thread's connections and those ended threads left idle, two per
        # node and per master at most, however many threads came and went (before: one
        # connection per thread to each node it read from and to the master it asked).
        assert open_fds() - without < 40  # 40 threads
        assert len(kv._data._conns) <= 3 * len(cluster.node_names)
        assert len(kv._masters._rpc_conns) <= 3 * len(cluster.master_addresses)
    assert kv.closed


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_warm_up_opens_what_the_first_calls_of_any_thread_use(
    cluster: LocalCluster, transport: str
) -> None:
    blocks = {f"warm/{transport}/{i}": os.urandom(4096 + i) for i in range(16)}
    with Client(cluster.master_addresses, timeout_s=5.0) as writer:
        assert writer.batch_put(blocks) == [True] * len(blocks)
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        report = kv.warm_up()
        assert report.ok, report.summary()
        assert set(report.nodes) == set(cluster.node_names)
        opened = len(kv._data._conns), len(kv._masters._rpc_conns)
        assert opened[0] == len(cluster.node_names)
        assert kv._data._conns.of_this_thread() == {}  # lent: any thread takes them
        if transport == "shm":  # the arenas' page tables are filled before the first calls
            arenas = list(shm_transport._ARENAS.values())
            assert arenas
            assert all(arena.wait_prefaulted(0) for arena in arenas)
        got: dict[str, bytes | None] = {}
        keys = list(blocks)
        reader = threading.Thread(
            target=lambda: got.update(zip(keys, kv.batch_get(keys), strict=True))
        )
        reader.start()
        reader.join(30)
        assert got == blocks
        assert (len(kv._data._conns), len(kv._masters._rpc_conns)) == opened  # none opened


@NEEDS_SHM
def test_an_async_clients_warm_up_maps_and_fills_the_nodes_shared_memory(
    cluster: LocalCluster,
) -> None:
    async def main() -> None:
        async with AsyncClient(cluster.master_addresses, timeout_s=5.0, transport="shm") as kv:
            report = await kv.warm_up()
            assert report.ok, report.summary()
            arenas = list(shm_transport._ARENAS.values())
            assert len(arenas) == len(cluster.node_names)
            assert all(arena.wait_prefaulted(0) for arena in arenas)
            assert await kv.put("warm/async/shm", b"v" * 4096)
            assert await kv.get("warm/async/shm") == b"v" * 4096

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_a_busy_polling_client_spins_for_reads_and_lookups_only(
    cluster: LocalCluster, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    polled: list[str] = []
    busy_poll = BlockingConnection.busy_poll

    def spy(conn: BlockingConnection, seconds: float) -> bool:
        polled.append(conn.address)
        assert seconds == 0.002
        return busy_poll(conn, seconds)

    monkeypatch.setattr(BlockingConnection, "busy_poll", spy)
    # Every read goes to its node (a same-host read of a listed block sends it nothing to wait
    # for: test_a_same_host_client_reads_committed_blocks_with_no_message_to_their_node).
    monkeypatch.setattr(client_links, "read_listed", lambda items, _arena, _content: items)
    blocks = {f"poll-{transport}/{n}": os.urandom(n) for n in (1, 4096, 2 * MIB)}
    keys = list(blocks)
    with Client(
        cluster.master_addresses,
        timeout_s=5.0,
        transport=transport,
        busy_poll_us=2000,
        lookup_cache_size=0,
    ) as kv:
        assert kv.batch_put(blocks) == [True] * len(blocks)
        assert kv.put(keys[0], blocks[keys[0]])
        assert polled == [], "a put waits for its stage and its commit asleep"
        assert kv.batch_get(keys) == list(blocks.values())
        assert kv.get(keys[2]) == blocks[keys[2]]
        assert kv.batch_exists([*keys, "poll/absent"]) == [True, True, True, False]
        assert kv.prefix_match([*keys, "poll/absent", keys[0]]) == 3
        assert polled, "reads and lookups spin before they sleep"
        offered = [members_of(a) for a in cluster.master_addresses]
        index_ports = {f"tcp://{m.rpc_address}" for m in offered}
        index_ports |= {f"tcp://{m.read_address}" for m in offered}
        assert index_ports & set(polled), "a lookup's answer is awaited spinning"
        assert set(polled) - index_ports, "a node's answer to a read is awaited spinning"
        assert kv.remove(keys[0])
        assert kv.get(keys[0]) is None


def scheme_blocks(tag: str) -> dict[str, bytes]:
    """Blocks under kvpool's own key scheme (keys that name their content), of every size."""
    ns = KeyNamespace(
        model=f"direct-{tag}-{os.getpid()}", dtype="bf16", kv_layout="t", block_size=2
    )
    keys = block_keys(ns, list(range(10)))
    sizes = (1, 4096, 70_000, 2 * MIB, 5 * MIB + 3)
    return dict(zip(keys, (os.urandom(n) for n in sizes), strict=True))


def count_lookups(kv: Client | AsyncClient) -> list[list[str]]:
    """Every Lookup the client asks from now on, by its keys."""
    asked: list[list[str]] = []
    request = kv.lookup_request

    def spy(names: list[str]) -> master_pb2.LookupRequest:
        asked.append(list(names))
        return request(names)

    kv.lookup_request = spy  # type: ignore[method-assign]
    return asked


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_a_block_put_by_one_client_is_read_by_another_with_no_lookup(
    cluster: LocalCluster, transport: str
) -> None:
    blocks = scheme_blocks(transport)
    keys = list(blocks)
    with Client(cluster.master_addresses, timeout_s=5.0) as writer:
        assert writer.batch_put(blocks) == [True] * len(blocks)
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        asked = count_lookups(kv)
        for key, value in blocks.items():
            assert kv.get(key) == value
            buf = bytearray(len(value))
            assert kv.get_into(key, buf) == len(value)
            assert buf == value
        assert kv.batch_get(keys) == list(blocks.values())
        bufs = [bytearray(len(v)) for v in blocks.values()]
        assert kv.batch_get_into(keys, bufs) == [len(v) for v in blocks.values()]
        assert bufs == list(blocks.values())
        assert asked == [], "every block was read from its node, the index never asked"
        assert kv.stats["direct_hits"] == 4 * len(blocks)
        assert kv.stats["direct_misses"] == 0
        # A buffer larger than the block: the node's answer does not fit the guess, so the
        # key is looked up and read as the index has it.
        big = bytearray(5000)
        assert kv.get_into(keys[1], big) == 4096
        assert big[:4096] == blocks[keys[1]]
        assert asked == [[keys[1]]]
        assert kv.stats["direct_misses"] == 1
        # A key of the scheme that nobody put: a miss after one Lookup.
        nobody = block_keys(
            KeyNamespace(model="nobody", dtype="bf16", kv_layout="t", block_size=2), [1, 2]
        )[0]
        assert kv.get(nobody) is None
        assert asked[-1] == [nobody]
        # Removed: the node dropped it, so the read by content misses and the index says gone.
        assert kv.remove(keys[0])
        assert kv.get(keys[0]) is None
    with Client(cluster.master_addresses, timeout_s=5.0, direct_reads="off") as off:
        asked = count_lookups(off)
        assert off.get(keys[2]) == blocks[keys[2]]
        assert asked == [[keys[2]]], "direct_reads='off' asks the index first"


READ_OPS = (Op.GET, Op.MGET, Op.SHM_GET)


@NEEDS_SHM
def test_a_same_host_client_reads_committed_blocks_with_no_message_to_their_node(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = scheme_blocks("listed")
    opaque = {f"listed/{os.getpid()}/{n}": os.urandom(n) for n in (10, 100_000)}
    everything = {**blocks, **opaque}
    with Client(cluster.master_addresses, timeout_s=5.0, transport="tcp") as writer:
        assert writer.batch_put(everything) == [True] * len(everything)
    sent: list[Op] = []
    send = ShmBlockingConnection.send
    exchange = shm_transport.ShmConnection.exchange

    def spy(self: ShmBlockingConnection, calls: list[Call], *args: object, **kw: object) -> None:
        sent.extend(Op(c.op) for c in calls)
        send(self, calls, *args, **kw)  # type: ignore[arg-type]

    async def async_spy(self: object, calls: list[Call], *args: object, **kw: object) -> None:
        sent.extend(Op(c.op) for c in calls)
        await exchange(self, calls, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ShmBlockingConnection, "send", spy)
    monkeypatch.setattr(shm_transport.ShmConnection, "exchange", async_spy)

    def reads() -> list[Op]:
        return [op for op in sent if op in READ_OPS]

    with Client(cluster.master_addresses, timeout_s=5.0, transport="shm") as kv:
        # A node lists a block once the index has confirmed its commit to it: soon after.
        deadline = time.monotonic() + 10
        while True:
            sent.clear()
            assert kv.batch_get(list(blocks)) == list(blocks.values())
            if not reads() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reads() == []
        for key, value in blocks.items():  # by content: read with no message, every time
            buf = bytearray(len(value))
            assert kv.get_into(key, buf) == len(value)
            assert buf == value
            assert kv.get(key) == value
        assert reads() == [], "read with no message to the node"
        assert kv.stats["misses_by_reason"]["checksum_mismatch"] == 0
    with Client(cluster.master_addresses, timeout_s=5.0, transport="shm") as kv:
        # Looked up: the entry names the newest write, read with no message to the node...
        assert kv.batch_get(list(opaque)) == list(opaque.values())
        assert reads() == []
        # ...and through the lookup cache the node is asked: it may name a replaced write.
        assert kv.batch_get(list(opaque)) == list(opaque.values())
        assert reads() != []
        sent.clear()

        async def read() -> list[bytes | None]:
            async with AsyncClient(cluster.master_addresses, timeout_s=5.0, transport="shm") as aio:
                return await aio.batch_get(list(everything))

        assert asyncio.run(read()) == list(everything.values())
        assert reads() == []
        # Removed: unlisted at once, for every client.
        key = next(iter(blocks))
        assert kv.remove(key)
        assert kv.get(key) is None
    with Client(cluster.master_addresses, timeout_s=5.0, transport="shm") as other:
        assert other.get(key) is None
        assert other.get(list(opaque)[1]) == list(opaque.values())[1]
    # A client reading back the blocks of the scheme it put itself, through the entries its
    # puts cached: no replaced value exists for such keys, so no message either.
    mine = scheme_blocks("listed-mine")
    with Client(cluster.master_addresses, timeout_s=5.0, transport="shm") as kv:
        assert kv.batch_put(mine) == [True] * len(mine)
        deadline = time.monotonic() + 10
        while True:  # listed once the node has read each PUBLISH: at once, or nearly
            sent.clear()
            assert kv.batch_get(list(mine)) == list(mine.values())
            if not reads() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for key, value in mine.items():
            buf = bytearray(len(value))
            assert kv.get_into(key, buf) == len(value)
            assert buf == value
        assert reads() == [], "its own blocks read with no message to the node"

    async def read_own() -> list[bytes | None]:
        async with AsyncClient(cluster.master_addresses, timeout_s=5.0, transport="shm") as aio:
            assert await aio.batch_put(mine) == [True] * len(mine)
            await asyncio.sleep(0.2)
            sent.clear()
            return await aio.batch_get(list(mine))

    assert asyncio.run(read_own()) == list(mine.values())
    assert reads() == []


def test_a_prefix_match_of_keys_read_by_content_brings_no_entries(cluster: LocalCluster) -> None:
    """A get of kvpool's scheme keys asks the index nothing, so prefix_match asks only for the
    count of them (no Lookup) and the read of the hits right after asks nothing either; a
    client that reads nothing by content still brings the entries its read goes through."""
    blocks = scheme_blocks("prefix")
    with Client(cluster.master_addresses, timeout_s=5.0) as writer:
        assert writer.batch_put(blocks) == [True] * len(blocks)
    keys = [*blocks, *scheme_blocks("prefix-absent")]
    values = list(blocks.values())
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        asked = count_lookups(kv)
        assert kv.prefix_match(keys) == len(blocks)
        assert kv.batch_get(keys[: len(blocks)]) == values
        assert asked == []
        assert kv.stats["direct_hits"] == len(blocks)
    with Client(cluster.master_addresses, timeout_s=5.0, direct_reads="off") as kv:
        asked = count_lookups(kv)
        assert kv.prefix_match(keys) == len(blocks)
        assert kv.batch_get(keys[: len(blocks)]) == values
        assert asked == [keys]  # the prefix_match's: the read goes through its entries


def test_the_async_client_reads_by_content_too(cluster: LocalCluster) -> None:
    blocks = scheme_blocks("async")
    with Client(cluster.master_addresses, timeout_s=5.0) as writer:
        assert writer.batch_put(blocks) == [True] * len(blocks)

    async def read() -> list[list[str]]:
        async with AsyncClient(cluster.master_addresses, timeout_s=5.0) as kv:
            asked = count_lookups(kv)
            for key, value in blocks.items():
                assert await kv.get(key) == value
            assert await kv.batch_get(list(blocks)) == list(blocks.values())
            return asked

    assert asyncio.run(read()) == []


def test_a_read_by_content_of_a_paused_node_is_served_by_the_next_member_in_time(
    cluster: LocalCluster,
) -> None:
    """Written with 2 replicas: a read by content tries the ring's first two members, hedging
    from a paused primary to the second — as a read through the index does."""
    blocks = scheme_blocks("paused")
    key = list(blocks)[2]
    with Client(cluster.master_addresses, timeout_s=3.0, replicas=2) as writer:
        assert writer.put(key, blocks[key])
        primary = writer.placement.place(key.encode(), 2)[0].node_id
    with Client(cluster.master_addresses, timeout_s=3.0, replicas=2, transport="tcp") as kv:
        # A warm reader: its ring loaded and a connection to the primary open (a connection
        # still to be opened to a paused node waits for its handshake, not for a hedge).
        assert kv.get(key) == blocks[key]
        asked = count_lookups(kv)
        cluster.pause(primary)
        try:
            started = time.monotonic()
            assert kv.get(key) == blocks[key]
            took = time.monotonic() - started
        finally:
            cluster.resume(primary)
        assert took < 1.0, f"the read waited {took:.2f} s for the paused node"
        assert asked == []
        assert kv.stats["hedge_wins"] == 1
        assert kv.stats["direct_hits"] == 2


def _pieces(data: bytes, cuts: list[int]) -> list[memoryview]:
    """``data`` split at ``cuts``, each piece in a buffer of its own (not adjacent in memory)."""
    bounds = [0, *cuts, len(data)]
    return [memoryview(bytearray(data[a:b])) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_block_in_pieces_is_put_from_them_and_read_into_them(
    cluster: LocalCluster, transport: str, api: str
) -> None:
    """A value given as a list of buffers is one block (their bytes joined), and a get_into a
    list of buffers fills them in order: single reads, batches (small blocks in one MGET, large
    ones through the node's shared memory), and buffers longer than the block."""
    tag = f"pieces/{transport}/{api}/{os.getpid()}"
    sizes = {"tiny": 10, "small": 5000, "mid": 70_000, "large": 2 * MIB + 3}
    blocks = {f"{tag}/{name}": os.urandom(n) for name, n in sizes.items()}
    cuts = {key: [1, len(v) // 3, len(v) - 1] for key, v in blocks.items()}

    def sinks() -> dict[str, list[memoryview]]:
        return {k: _pieces(bytes(len(v)), cuts[k]) for k, v in blocks.items()}

    def joined(pieces: list[memoryview]) -> bytes:
        return b"".join(bytes(p) for p in pieces)

    if api == "sync":
        with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
            items = [(k, _pieces(v, cuts[k])) for k, v in blocks.items()]
            assert kv.batch_put(items) == [True] * len(blocks)
            one = sinks()
            for key, value in blocks.items():
                assert kv.get_into(key, one[key]) == len(value)
                assert joined(one[key]) == value
            many = sinks()
            assert kv.batch_get_into(list(blocks), list(many.values())) == [
                len(v) for v in blocks.values()
            ]
            assert all(joined(many[k]) == v for k, v in blocks.items())
            longer = [bytearray(7), bytearray(len(blocks[f"{tag}/large"]))]
            assert kv.get_into(f"{tag}/large", longer) == len(blocks[f"{tag}/large"])
            assert (bytes(longer[0]) + bytes(longer[1]))[: len(blocks[f"{tag}/large"])] == (
                blocks[f"{tag}/large"]
            )
    else:

        async def run() -> None:
            async with AsyncClient(
                cluster.master_addresses, timeout_s=5.0, transport=transport
            ) as kv:
                items = [(k, _pieces(v, cuts[k])) for k, v in blocks.items()]
                assert await kv.batch_put(items) == [True] * len(blocks)
                one = sinks()
                for key, value in blocks.items():
                    assert await kv.get_into(key, one[key]) == len(value)
                    assert joined(one[key]) == value
                many = sinks()
                got = await kv.batch_get_into(list(blocks), list(many.values()))
                assert got == [len(v) for v in blocks.values()]
                assert all(joined(many[k]) == v for k, v in blocks.items())

        asyncio.run(run())
    # Another client reads the blocks whole: a block put in pieces is the pieces joined.
    with Client(cluster.master_addresses, timeout_s=5.0, transport="tcp") as other:
        assert other.batch_get(list(blocks)) == list(blocks.values())


@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=NEEDS_SHM)])
def test_a_block_in_pieces_is_read_by_content_into_pieces(
    cluster: LocalCluster, transport: str
) -> None:
    """Keys that name their content are read with no lookup, into pieces too — the pieces
    exactly the block, or longer (the block fills their first bytes)."""
    blocks = scheme_blocks(f"pieces-{transport}")
    with Client(cluster.master_addresses, timeout_s=5.0) as writer:
        items = [(k, _pieces(v, [len(v) // 2])) for k, v in blocks.items()]
        assert writer.batch_put(items) == [True] * len(blocks)
    with Client(cluster.master_addresses, timeout_s=5.0, transport=transport) as kv:
        asked = count_lookups(kv)
        for key, value in blocks.items():
            sink = _pieces(bytes(len(value)), [len(value) // 3])
            assert kv.get_into(key, sink) == len(value)
            assert b"".join(bytes(p) for p in sink) == value
        assert asked == []
        for key, value in blocks.items():
            longer = [bytearray(3), bytearray(len(value) + 5)]
            assert kv.get_into(key, longer) == len(value)
            assert (bytes(longer[0]) + bytes(longer[1]))[: len(value)] == value
