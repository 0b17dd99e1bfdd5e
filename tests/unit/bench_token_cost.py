"""What the cluster token costs on the data path (not a test; run it by hand):

    .venv/bin/python -m tests.unit.bench_token_cost      (from the repository root)

Two in-process nodes, one with a token and one without, on loopback; interleaved rounds of (a)
opening a connection and getting its first answer (the token adds the AUTH round trip) and (b)
4 KiB GETs over one open connection (nothing is checked per frame). Medians of 7 rounds.
With ``cluster``: the public Client against real processes instead.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from kvpool.checksum import block_checksum
from kvpool.proto.wire import Op, Status
from kvpool.store_node.data_server import DataServer
from kvpool.transports import open_connection
from kvpool.transports.tcp import FrameConnection
from tests.unit.test_security import TOKEN, node


async def _setup(server: DataServer, data: bytes) -> FrameConnection:
    conn = await open_connection(f"tcp://127.0.0.1:{server.port}", 5, server.gate.token)
    checksum = block_checksum(data)
    r = await conn.request(Op.PUT, b"k", write_id=1, checksum=checksum, payload=data, timeout_s=5)
    assert r.status == Status.OK, r.message()
    r = await conn.request(Op.PUBLISH, b"k", write_id=1, version=1, timeout_s=5)
    assert r.status == Status.OK, r.message()
    return conn


async def _opens(server: DataServer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        conn = await open_connection(f"tcp://127.0.0.1:{server.port}", 5, server.gate.token)
        r = await conn.request(Op.PING, b"", timeout_s=5)
        assert r.status == Status.OK
        conn.close()
    return (time.perf_counter() - t0) / n * 1e6


async def _gets(conn: FrameConnection, n: int, size: int) -> float:
    sink = memoryview(bytearray(size))
    t0 = time.perf_counter()
    for _ in range(n):
        r = await conn.request(Op.GET, b"k", write_id=1, sink=sink, timeout_s=5)
        assert r.status == Status.OK
    return n / (time.perf_counter() - t0)


async def main() -> None:
    data = b"x" * 4096
    opens: dict[bool, list[float]] = {True: [], False: []}
    gets: dict[bool, list[float]] = {True: [], False: []}
    async with node(TOKEN) as with_token, node(b"") as without:
        conns = {True: await _setup(with_token, data), False: await _setup(without, data)}
        servers = {True: with_token, False: without}
        for _ in range(7):
            for token in (True, False):
                opens[token].append(await _opens(servers[token], 200))
                gets[token].append(await _gets(conns[token], 3000, len(data)))
        for conn in conns.values():
            conn.close()
    for name, series in (("open + first PING, us", opens), ("4 KiB GETs per s", gets)):
        t, n = statistics.median(series[True]), statistics.median(series[False])
        print(f"{name}: token {t:.1f}, no token {n:.1f}, ratio {t / n:.3f}")


def cluster_bench(rounds: int = 5, gets_per_round: int = 1000) -> None:
    """The same through the public Client against real processes (1 master + 1 node each, one
    cluster with a token, one without): gets per second, interleaved rounds."""
    import tempfile

    from kvpool import Client
    from kvpool.launcher.cluster import LocalCluster

    rates: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {
            token: LocalCluster(
                f"{tmp}/{token}", masters=1, nodes=1, cpu_cache_size="64MiB", cluster_token=token
            )
            for token in (True, False)
        }
        try:
            for cluster in clusters.values():
                cluster.start()
            clients = {
                token: Client(
                    c.client_master_addresses, cluster_token_file=c.token_file, transport="tcp"
                )
                for token, c in clusters.items()
            }
            for kv in clients.values():
                assert kv.put("bench/k", b"x" * 4096)
            for _ in range(rounds):
                for token, kv in clients.items():
                    t0 = time.perf_counter()
                    for _ in range(gets_per_round):
                        assert kv.get("bench/k") is not None
                    rates[token].append(gets_per_round / (time.perf_counter() - t0))
            for kv in clients.values():
                kv.close()
        finally:
            for cluster in clusters.values():
                cluster.stop()
    t, n = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"Client.get 4 KiB per s (tcp): token {t:.0f}, no token {n:.0f}, ratio {t / n:.3f}")


if __name__ == "__main__":
    import sys

    if "cluster" in sys.argv[1:]:
        cluster_bench()
    else:
        asyncio.run(main())
