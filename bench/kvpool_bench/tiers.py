"""Tier benchmark (``kvpool-bench tiers``): the numbers the tiered store is judged by.

- ``flood`` — a node (data server + CPU tier + SSD tier of three times the CPU tier, in a child
  process as in production) takes a write flood of six times its CPU tier over loopback TCP:
  puts/s, demotions/s and the SSD write rate, SSD evictions/s once the SSD fills too (segments
  reclaimed, whole segments, down to the low watermark), blocks held at the end, and NO_SPACE
  refusals (the back-pressure while demotions drain).
- ``get`` — then GET throughput over TCP, pipelined: blocks in CPU memory against blocks only on
  the SSD (each read once, so that none is promoted by the measurement itself), in GB/s.
- ``policy`` — the pure core alone: eviction decisions per second (S3-FIFO and LRU) with the CPU
  tier held above its high watermark by puts, no I/O.
- ``restart`` — warm-restart time: N blocks on the SSD tier, the tier closed and reopened, the
  manifest replayed and every block read back and verified.

    python -m kvpool_bench.tiers [--quick] [--json] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvpool.checksum import block_checksum
from kvpool.proto.wire import MissReason, Op, Status, TierLevel
from kvpool.transports.tcp import TcpConnection

TIMEOUT_S = 30.0
MIB = 1 << 20


def _serve(
    directory: str, cpu_bytes: int, ssd_bytes: int, block_bytes: int, pipe: Connection
) -> None:
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.data_server import DataServer
    from kvpool.store_node.eviction import S3FifoPolicy
    from kvpool.store_node.tier_worker import TierWorker
    from kvpool.store_node.tiers.cpu import CpuTier
    from kvpool.store_node.tiers.ssd import SsdTier

    async def main() -> None:
        cpu = CpuTier(cpu_bytes)
        await asyncio.to_thread(cpu.prefault)
        ssd = SsdTier(directory, ssd_bytes, max(16 * MIB, block_bytes))
        store = BlockStore(
            cpu, S3FifoPolicy(), max_block_size=block_bytes, clock=time.monotonic, ssd=ssd
        )
        worker = TierWorker(store)
        worker.start()
        server = DataServer(store, worker=worker)
        port = await server.start("127.0.0.1", 0)
        pipe.send((port, ssd.detail))
        while True:
            message = await asyncio.to_thread(pipe.recv)
            if message == "stop":
                break
            await worker.idle()
            stats = store.stats()
            pipe.send(
                {
                    "tiers": {
                        t.name: {
                            "used_bytes": t.used_bytes,
                            "blocks": t.blocks,
                            "hits": t.hits,
                            "evictions": t.evictions,
                            "demotions": t.demotions,
                            "promotions": t.promotions,
                            "fragmentation": round(t.fragmentation, 3),
                        }
                        for t in stats.tiers
                    },
                    "evictions": stats.evictions,
                    "no_space": store.counters.no_space,
                    "ssd_write_s": worker.write_seconds,
                    "ssd_written_bytes": worker.written_bytes,
                }
            )
        await server.close()
        await worker.stop()
        cpu.close()
        ssd.close()

    asyncio.run(main())


async def _flood_and_get(
    port: int, pipe: Connection, *, block_bytes: int, blocks: int, depth: int
) -> dict[str, Any]:
    conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)
    payloads = [bytes([i % 251]) * block_bytes for i in range(8)]
    sums = [block_checksum(p) for p in payloads]
    refused = 0
    try:
        started = time.perf_counter()
        next_key = 0
        done = 0
        half_s = 0.0  # when the first half (three times the CPU tier: it all fits) was in

        async def writer() -> None:
            nonlocal next_key, refused, done, half_s
            while next_key < blocks:
                i = next_key
                next_key += 1
                key = f"b{i}".encode()
                while True:
                    r = await conn.request(
                        Op.PUT, key, write_id=1, checksum=sums[i % 8], payload=payloads[i % 8],
                        timeout_s=TIMEOUT_S,
                    )  # fmt: skip
                    if r.status != Status.NO_SPACE:
                        break
                    refused += 1
                    await asyncio.sleep(0.002)
                assert r.status == Status.OK, r.message()
                r = await conn.request(Op.PUBLISH, key, write_id=1, version=1, timeout_s=TIMEOUT_S)
                assert r.status == Status.OK
                done += 1
                if done == blocks // 2:
                    half_s = time.perf_counter() - started

        await asyncio.gather(*(writer() for _ in range(depth)))
        flood_s = time.perf_counter() - started
        pipe.send("stats")
        after_flood = await asyncio.to_thread(pipe.recv)
        drained_s = time.perf_counter() - started

        # Which blocks are where: a GET limited to CPU memory misses the SSD ones (SLOW_TIER);
        # blocks beyond what CPU + SSD hold are gone (evicted).
        where: dict[int, list[int]] = {int(TierLevel.CPU): [], int(TierLevel.SSD): []}
        sink = memoryview(bytearray(block_bytes))
        for i in range(blocks):
            r = await conn.request(
                Op.GET, f"b{i}".encode(), write_id=1, flags=int(TierLevel.CPU), sink=sink,
                timeout_s=TIMEOUT_S,
            )  # fmt: skip
            if r.status == Status.OK:
                where[int(TierLevel.CPU)].append(i)
            elif r.header.flags == MissReason.SLOW_TIER:
                where[int(TierLevel.SSD)].append(i)

        async def read_all(indexes: list[int]) -> tuple[float, int]:
            sinks = [memoryview(bytearray(block_bytes)) for _ in range(depth)]
            todo = list(indexes)
            ok = 0

            async def reader(w: int) -> None:
                nonlocal ok
                while todo:
                    i = todo.pop()
                    r = await conn.request(
                        Op.GET, f"b{i}".encode(), write_id=1, sink=sinks[w], timeout_s=TIMEOUT_S
                    )
                    ok += r.status == Status.OK and r.header.checksum == sums[i % 8]

            t0 = time.perf_counter()
            await asyncio.gather(*(reader(w) for w in range(depth)))
            return time.perf_counter() - t0, ok

        cpu_s, cpu_ok = await read_all(where[int(TierLevel.CPU)] * 3)
        ssd_s, ssd_ok = await read_all(where[int(TierLevel.SSD)])
        pipe.send("stats")
        after_gets = await asyncio.to_thread(pipe.recv)
    finally:
        conn.close()
    demotions = after_flood["tiers"]["cpu"]["demotions"]
    reclaimed = after_flood["tiers"]["ssd"]["evictions"]
    cpu_bytes = cpu_ok * block_bytes
    ssd_bytes = ssd_ok * block_bytes
    return {
        "flood": {
            "block": f"{block_bytes >> 10} KiB",
            "blocks": blocks,
            "puts_per_s": round(blocks / flood_s),
            "put_mb_per_s": round(blocks * block_bytes / flood_s / 1e6, 1),
            "first_half_put_mb_per_s": round(blocks // 2 * block_bytes / half_s / 1e6, 1),
            "demotions": demotions,
            "demotions_per_s": round(demotions / drained_s),
            "ssd_write_mb_per_s": round(
                after_flood["ssd_written_bytes"] / max(after_flood["ssd_write_s"], 1e-9) / 1e6
            ),
            "ssd_evictions": reclaimed,
            "ssd_evictions_per_s": round(reclaimed / drained_s),
            "blocks_lost": after_flood["evictions"],
            "blocks_held": after_flood["tiers"]["cpu"]["blocks"]
            + after_flood["tiers"]["ssd"]["blocks"],
            "no_space_refusals": refused,
            "tiers": after_flood["tiers"],
        },
        "get": {
            "depth": depth,
            "cpu_blocks": cpu_ok,
            "cpu_gb_per_s": round(cpu_bytes / cpu_s / 1e9, 2) if cpu_ok else None,
            "ssd_blocks": ssd_ok,
            "ssd_gb_per_s": round(ssd_bytes / ssd_s / 1e9, 2) if ssd_ok else None,
            "ssd_hits": after_gets["tiers"]["ssd"]["hits"],
        },
    }


def bench_flood(
    directory: Path, *, cpu_bytes: int, block_bytes: int, depth: int = 16
) -> dict[str, Any]:
    """A write flood of six times the CPU tier into CPU + an SSD of three times it (the last
    blocks push the first out: SSD evictions), then CPU vs SSD GET throughput."""
    blocks = 6 * cpu_bytes // block_bytes
    ssd_bytes = 3 * cpu_bytes
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_serve,
        args=(str(directory / "ssd"), cpu_bytes, ssd_bytes, block_bytes, child),
        daemon=True,
    )
    proc.start()
    try:
        port, detail = parent.recv()
        result = asyncio.run(
            _flood_and_get(port, parent, block_bytes=block_bytes, blocks=blocks, depth=depth)
        )
        result["ssd_tier"] = detail
        return result
    finally:
        parent.send("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join()


def bench_policy(blocks: int) -> dict[str, Any]:
    """Eviction decisions per second in the pure core (CPU tier only, no I/O)."""
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.eviction import make_policy
    from kvpool.store_node.tiers.cpu import CpuTier

    out: dict[str, Any] = {}
    size = 4096
    for name in ("s3fifo", "lru"):
        tier = CpuTier(4096 * size)
        store = BlockStore(tier, make_policy(name), max_block_size=size, clock=time.monotonic)
        checksum = block_checksum(bytes(size))
        started = time.perf_counter()
        for i in range(blocks):
            key = f"k{i}"
            verdict = store.reserve(key, 1, size, checksum)
            assert verdict.block is not None
            assert store.finish_put(verdict.block) == Status.OK
            store.publish(key, 1, i + 1)
            if i % 3 == 0:  # a third of the blocks are read (and so protected) once
                result = store.get(f"k{i // 2}", 1)
                if result.copy is not None:
                    store.release(result.copy)
        elapsed = time.perf_counter() - started
        evictions = store.counters.evictions
        out[name] = {
            "puts": blocks,
            "evictions": evictions,
            "puts_per_s": round(blocks / elapsed),
            "evictions_per_s": round(evictions / elapsed),
        }
        tier.close()
    return out


def bench_restart(directory: Path, blocks: int, block_bytes: int) -> dict[str, Any]:
    """Time to find ``blocks`` SSD blocks again: replay, read back, verify, restore."""
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.eviction import S3FifoPolicy
    from kvpool.store_node.tier_worker import TierWorker
    from kvpool.store_node.tiers.cpu import CpuTier
    from kvpool.store_node.tiers.ssd import SsdTier
    from kvpool.store_node.warm_restart import recover_ssd, restore_into

    path = directory / "restart-ssd"
    ssd_bytes = (blocks * block_bytes * 5 // 4 // (16 * MIB) + 2) * 16 * MIB
    cpu = CpuTier(64 * block_bytes)
    ssd = SsdTier(path, ssd_bytes, 16 * MIB)
    store = BlockStore(cpu, S3FifoPolicy(), max_block_size=block_bytes, clock=time.monotonic,
                       ssd=ssd)  # fmt: skip
    worker = TierWorker(store)
    data = bytes(range(256)) * (block_bytes // 256)
    checksum = block_checksum(data)
    for i in range(blocks):
        verdict = store.reserve(f"r{i}", 1, block_bytes, checksum)
        assert verdict.block is not None
        store.view(verdict.block)[:] = data
        store.finish_put(verdict.block)
        store.publish(f"r{i}", 1, i + 1)
        worker.run_blocking()
    store.tiers.relieve(force_bytes=cpu.capacity_bytes)
    worker.run_blocking()
    on_ssd = store.tiers.copies_on(TierLevel.SSD)
    ssd.close()
    cpu.close()

    cpu2 = CpuTier(64 * block_bytes)
    ssd2 = SsdTier(path, ssd_bytes, 16 * MIB)
    store2 = BlockStore(cpu2, S3FifoPolicy(), max_block_size=block_bytes, clock=time.monotonic,
                        ssd=ssd2)  # fmt: skip
    started = time.perf_counter()
    recovery = recover_ssd(ssd2)
    held = restore_into(store2, recovery)
    elapsed = time.perf_counter() - started
    direct_io = ssd2.direct_io
    ssd2.close()
    cpu2.close()
    return {
        "blocks_on_ssd": on_ssd,
        "block": f"{block_bytes >> 10} KiB",
        "recovered": held,
        "corrupt": recovery.corrupt,
        "seconds": round(elapsed, 3),
        "verify_gb_per_s": round(recovery.verified_bytes / max(recovery.seconds, 1e-9) / 1e9, 2),
        "direct_io": direct_io,
    }


def run_all(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-tiers-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result: dict[str, Any] = {}
        result.update(
            bench_flood(root, cpu_bytes=(64 if quick else 256) * MIB, block_bytes=1 * MIB)
        )
        result["policy"] = bench_policy(20_000 if quick else 200_000)
        result["restart"] = bench_restart(root, 2_000 if quick else 10_000, 64 << 10)
        return result
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool_bench.tiers")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", help="where the SSD tier files go [a temp dir]")
    args = parser.parse_args(argv)
    result = run_all(quick=args.quick, directory=args.dir)
    if args.json:
        print(json.dumps(result, indent=2))
    else:

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                print(f"{prefix:50s} {value}")

        walk("", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
