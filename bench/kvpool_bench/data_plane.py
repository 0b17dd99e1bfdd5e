"""Data-plane benchmark: PUT and GET against one node's data server over loopback.

The data server runs in a child process (as in production, its own interpreter and event loop);
the client is one :class:`~kvpool.transports.tcp.TcpConnection` in this process. For each block
size it measures PUT then GET, one request at a time (latency) and with ``depth`` requests in
flight on the same connection (pipelined throughput). Every GET's bytes are checked.

    kvpool-bench data-plane [--sizes 4096,1048576] [--depths 1,16] [--no-prefault]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvpool.checksum import block_checksum
from kvpool.proto.wire import Op, Status
from kvpool.transports.tcp import TcpConnection

TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Result:
    op: str
    size_bytes: int
    depth: int
    requests: int
    p50_us: float
    p99_us: float
    mb_per_s: float

    def row(self) -> str:
        return (
            f"{self.op:<4} {self.size_bytes:>9} B  depth {self.depth:>3}  n={self.requests:<6} "
            f"p50 {self.p50_us:>9.1f} us  p99 {self.p99_us:>9.1f} us  {self.mb_per_s:>8.1f} MB/s"
        )


def _serve(capacity_bytes: int, max_block_bytes: int, prefault: bool, pipe: Connection) -> None:
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.cpu_tier import CpuTier
    from kvpool.store_node.data_server import DataServer
    from kvpool.store_node.eviction import LruPolicy

    async def main() -> None:
        tier = CpuTier(capacity_bytes)
        if prefault:  # as the node does at start (cpu_tier_prefault)
            await asyncio.to_thread(tier.prefault)
        store = BlockStore(tier, LruPolicy(), max_block_size=max_block_bytes, clock=time.monotonic)
        server = DataServer(store)
        port = await server.start("127.0.0.1", 0)
        pipe.send(port)
        await asyncio.to_thread(pipe.recv)  # any message: stop
        await server.close()
        tier.close()

    asyncio.run(main())


async def _timed(
    depth: int, requests: int, one: Callable[[int, int], Awaitable[None]]
) -> tuple[list[float], float]:
    """Run ``one(request_index, worker_index)`` ``requests`` times, ``depth`` at once."""
    latencies: list[float] = []
    next_index = 0

    async def worker(w: int) -> None:
        nonlocal next_index
        while next_index < requests:
            i = next_index
            next_index += 1
            t0 = time.perf_counter()
            await one(i, w)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(depth)))
    return latencies, time.perf_counter() - start


def _result(op: str, size: int, depth: int, latencies: list[float], elapsed: float) -> Result:
    ordered = sorted(latencies)
    return Result(
        op=op,
        size_bytes=size,
        depth=depth,
        requests=len(ordered),
        p50_us=statistics.median(ordered) * 1e6,
        p99_us=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
        mb_per_s=size * len(ordered) / elapsed / 1e6,
    )


async def bench_connection(
    conn: TcpConnection, size: int, requests: int, depth: int, tag: str
) -> list[Result]:
    """PUT ``requests`` blocks of ``size`` bytes, publish them, GET them back (checked)."""
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    checksum = block_checksum(payload)
    keys = [f"{tag}/{size}/{depth}/{i}".encode() for i in range(requests)]

    async def put(i: int, _worker: int) -> None:
        r = await conn.request(
            Op.PUT, keys[i], write_id=1, checksum=checksum, payload=payload, timeout_s=TIMEOUT_S
        )
        if r.status != Status.OK:
            raise RuntimeError(f"PUT {keys[i]!r}: status {r.status} {r.message()}")

    sinks = [bytearray(size) for _ in range(depth)]  # one per worker: no sharing in flight

    async def get(i: int, worker: int) -> None:
        sink = sinks[worker]
        r = await conn.request(
            Op.GET, keys[i], write_id=1, sink=memoryview(sink), timeout_s=TIMEOUT_S
        )
        if r.status != Status.OK or r.header.checksum != checksum:
            raise RuntimeError(f"GET {keys[i]!r}: status {r.status} flags {r.header.flags}")
        if i % 64 == 0 and sink != payload:  # spot-check the bytes themselves
            raise RuntimeError(f"GET {keys[i]!r} returned other bytes")

    put_lat, put_s = await _timed(depth, requests, put)
    await asyncio.gather(
        *(conn.request(Op.PUBLISH, k, write_id=1, version=1, timeout_s=TIMEOUT_S) for k in keys)
    )
    get_lat, get_s = await _timed(depth, requests, get)
    return [
        _result("PUT", size, depth, put_lat, put_s),
        _result("GET", size, depth, get_lat, get_s),
    ]


async def bench_data_plane(
    port: int, sizes: list[int], depths: list[int], budget_bytes: int
) -> list[Result]:
    results: list[Result] = []
    conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)
    try:
        for size in sizes:
            requests = max(200, min(20_000, budget_bytes // max(size, 1)))
            for depth in depths:
                await bench_connection(conn, size, min(requests, 200), depth, "warm")
                results += await bench_connection(conn, size, requests, depth, "run")
    finally:
        conn.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool-bench data-plane")
    parser.add_argument("--sizes", default="4096,1048576")
    parser.add_argument("--depths", default="1,16")
    parser.add_argument("--budget-mib", type=int, default=512, help="bytes moved per case")
    parser.add_argument("--arena-mib", type=int, default=2048)
    parser.add_argument(
        "--no-prefault", action="store_true", help="leave the arena cold (first-touch faults)"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_serve,
        args=(args.arena_mib << 20, max(sizes) + 1, not args.no_prefault, child),
        daemon=True,
    )
    proc.start()
    try:
        port = parent.recv()
        results = asyncio.run(bench_data_plane(port, sizes, depths, args.budget_mib << 20))
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for result in results:
        print(result.row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
