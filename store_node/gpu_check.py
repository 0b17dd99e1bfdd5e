"""Checks of the GPU tier on a machine with a CUDA device.

    python -m kvpool.store_node.gpu_check [--device N] [--no-pytest]


Self-contained: it installs nothing (cupy must already be importable: ``pip install
'kvpool[gpu]'``), writes only under a temporary directory, starts no other process, and prints
every check with its result. Exit status: 0 all passed, 1 a check failed, 2 no usable GPU here
(the reason is printed; nothing was checked).

Checks, in order:

1. ``probe`` — cupy imports, the device exists; its name and memory.
2. ``tier_roundtrip`` — a :class:`GpuTier`: allocations are 256-byte aligned and never overlap;
   host → device → host copies at many offsets and sizes (0 B to 8 MiB) come back byte for byte.
3. ``promotion`` — a block store with CPU + GPU + SSD tiers: blocks read often are copied up to
   the GPU; with the CPU tier emptied, reads are served from the GPU, byte exact.
4. ``demotion`` — GPU pressure: GPU-only blocks are demoted to the SSD (device → staging →
   one aligned write), none lost, all byte exact.
5. ``data_plane`` — a data server over loopback TCP serving GPU-resident blocks (response
   flags name the GPU tier), checked, and the device → host read throughput (GB/s).
6. ``pytest`` — the ``gpu``-marked tests (``tests/unit/test_gpu_tier.py``) when pytest and the
   tests are present; skipped (and said so) otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.checksum import block_checksum
from kvpool.proto.wire import Op, Status, TierLevel

MIB = 1 << 20


class CheckFailedError(AssertionError):
    pass


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailedError(what)


def check_probe(device: int) -> str:
    from kvpool.store_node.tiers.gpu import _cupy, probe_gpu

    reason = probe_gpu(device)
    if reason is not None:
        raise CheckFailedError(reason)
    cupy = _cupy()
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    with cupy.cuda.Device(device):
        free, total = cupy.cuda.runtime.memGetInfo()
    return f"device {device}: {name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"


def check_tier_roundtrip(device: int) -> str:
    from kvpool.store_node.tiers.gpu import GpuTier

    tier = GpuTier(256 * MIB, device=device)
    rng = random.Random(1)
    try:
        live: dict[int, bytes] = {}
        for size in [0, 1, 255, 256, 4097, 65536, MIB + 3, 8 * MIB] + [
            rng.randint(1, 2 * MIB) for _ in range(40)
        ]:
            offset = tier.alloc(size)
            _require(offset is not None, f"allocation of {size} bytes failed")
            assert offset is not None
            _require(offset % 256 == 0, f"offset {offset} is not 256-byte aligned")
            data = rng.randbytes(size)
            tier.write_from(offset, memoryview(data))
            live[offset] = data
        ends = sorted((o, o + tier.footprint(len(d))) for o, d in live.items())
        for (_, end), (start, _) in itertools.pairwise(ends):
            _require(end <= start, "GPU allocations overlap")
        for offset, data in live.items():  # every block intact after all the writes
            back = bytearray(len(data))
            tier.read_into(offset, memoryview(back))
            _require(bytes(back) == data, f"bytes at {offset} came back different")
        for offset in list(live):
            tier.free(offset)
        _require(tier.used_bytes == 0, "freeing everything did not empty the tier")
        return f"{len(live)} blocks, 0 B to 8 MiB, byte exact; allocator empty after frees"
    finally:
        tier.close()


def _tiered_store(directory: Path, device: int) -> tuple[Any, Any, Any, Any, Any]:
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.eviction import S3FifoPolicy
    from kvpool.store_node.tier_worker import TierWorker
    from kvpool.store_node.tiers.cpu import CpuTier
    from kvpool.store_node.tiers.gpu import GpuTier
    from kvpool.store_node.tiers.ssd import SsdTier

    cpu = CpuTier(64 * MIB)
    gpu = GpuTier(32 * MIB, device=device)
    ssd = SsdTier(directory / "ssd", 256 * MIB, 16 * MIB)
    store = BlockStore(
        cpu,
        S3FifoPolicy(),
        max_block_size=4 * MIB,
        clock=time.monotonic,
        ssd=ssd,
        gpu=gpu,
        gpu_policy=S3FifoPolicy(),
        gpu_promote_after_hits=2,
    )
    return store, TierWorker(store), cpu, gpu, ssd


def _value(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def _read(store: Any, worker: Any, key: str) -> tuple[bytes | None, TierLevel]:
    result = store.get(key, 1)
    if result.copy is None:
        return None, TierLevel.ANY
    if result.copy.level is TierLevel.CPU:
        data = bytes(store.view_copy(result.copy))
        store.release(result.copy)
        return data, TierLevel.CPU
    return worker.read_blocking(result), result.copy.level


def check_promotion_and_demotion(device: int, directory: Path) -> tuple[str, str]:
    store, worker, cpu, gpu, ssd = _tiered_store(directory, device)
    size = MIB
    try:
        keys = [f"g{i}" for i in range(24)]
        for i, key in enumerate(keys):
            data = _value(i, size)
            verdict = store.reserve(key, 1, size, block_checksum(data))
            _require(verdict.block is not None, f"put {key} refused: {verdict.message}")
            store.view(verdict.block)[:] = data
            _require(store.finish_put(verdict.block) == Status.OK, f"put {key} failed")
            store.publish(key, 1, i + 1)
            for _ in range(2):  # read twice: hot enough for the GPU
                _read(store, worker, key)
            worker.run_blocking()
        on_gpu = [k for k in keys if TierLevel.GPU in store.block(k, 1).copies]
        _require(bool(on_gpu), "no block was promoted to the GPU")
        store.tiers.relieve(force_bytes=cpu.capacity_bytes)  # empty the CPU tier
        worker.run_blocking()
        served: dict[str, int] = {}
        for i, key in enumerate(keys):
            got, level = _read(store, worker, key)
            _require(got == _value(i, size), f"{key} read wrong from {level.name}")
            served[level.name.lower()] = served.get(level.name.lower(), 0) + 1
        _require(served.get("gpu", 0) > 0, f"nothing was served from the GPU: {served}")
        promotion = (
            f"{len(on_gpu)} blocks promoted to the GPU; with CPU memory emptied, reads served "
            f"by tier {served}, all byte exact"
        )
        gpu_only = [k for k in keys if set(store.block(k, 1).copies) == {TierLevel.GPU}]
        store.tiers.drain(TierLevel.GPU, gpu.capacity_bytes)
        worker.run_blocking()
        store.check_invariants()
        for i, key in enumerate(keys):
            got, _ = _read(store, worker, key)
            _require(got == _value(i, size), f"{key} lost or wrong after GPU demotion")
        _require(store.stats().evictions == 0, "blocks were lost")
        demotion = (
            f"{len(gpu_only)} GPU-only blocks demoted to the SSD; all {len(keys)} blocks read "
            "back byte exact, none lost"
        )
        return promotion, demotion
    finally:
        gpu.close()
        ssd.close()
        cpu.close()


def check_data_plane(device: int, directory: Path) -> str:
    from kvpool.store_node.data_server import DataServer
    from kvpool.transports.tcp import TcpConnection

    store, worker, cpu, gpu, ssd = _tiered_store(directory, device)
    size = 4 * MIB

    async def run() -> str:
        worker.start()
        server = DataServer(store, worker=worker)
        port = await server.start("127.0.0.1", 0)
        conn = await TcpConnection.open("127.0.0.1", port, timeout_s=10)
        try:
            keys = [f"d{i}" for i in range(6)]
            for i, key in enumerate(keys):
                data = _value(100 + i, size)
                r = await conn.request(
                    Op.PUT, key.encode(), write_id=1, checksum=block_checksum(data),
                    payload=data, timeout_s=10,
                )  # fmt: skip
                _require(r.status == Status.OK, f"PUT {key}: {r.status}")
                await conn.request(Op.PUBLISH, key.encode(), write_id=1, version=i + 1,
                                   timeout_s=10)  # fmt: skip
            sink = memoryview(bytearray(size))
            for _ in range(3):
                for key in keys:
                    await conn.request(Op.GET, key.encode(), write_id=1, sink=sink, timeout_s=10)
            await worker.idle()
            store.tiers.relieve(force_bytes=cpu.capacity_bytes)
            await worker.idle()
            gpu_keys = [k for k in keys if store.block(k, 1).fastest().level is TierLevel.GPU]
            _require(bool(gpu_keys), "no block is served from the GPU")
            moved = 0
            started = time.perf_counter()
            for _ in range(10):
                for i, key in enumerate(keys):
                    r = await conn.request(Op.GET, key.encode(), write_id=1, sink=sink,
                                           timeout_s=10)  # fmt: skip
                    _require(r.status == Status.OK, f"GET {key}: {r.status}")
                    _require(bytes(sink) == _value(100 + i, size), f"GET {key}: wrong bytes")
                    if key in gpu_keys:
                        _require(r.header.flags == TierLevel.GPU, f"{key} not served by the GPU")
                        moved += size
            elapsed = time.perf_counter() - started
            return (
                f"{len(gpu_keys)} GPU-resident 4 MiB blocks served over TCP with the GPU tier "
                f"flag, byte exact; {moved / elapsed / 1e9:.2f} GB/s end to end (device to "
                "host, checksum, loopback TCP, compare)"
            )
        finally:
            conn.close()
            await server.close()
            await worker.stop()

    try:
        return asyncio.run(run())
    finally:
        gpu.close()
        ssd.close()
        cpu.close()


def check_pytest() -> str:
    tests = Path(__file__).resolve().parents[1] / "tests" / "unit" / "test_gpu_tier.py"
    if not tests.exists():
        return "skipped: tests/unit/test_gpu_tier.py is not here (an installed package)"
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "skipped: pytest is not installed (pip install 'kvpool[dev]')"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    tail = (proc.stdout or proc.stderr).strip().splitlines()[-1:]
    if proc.returncode != 0:
        raise CheckFailedError(
            f"pytest -m gpu failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
        )
    return tail[0] if tail else "passed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.store_node.gpu_check")
    parser.add_argument("--device", type=int, default=0, help="CUDA device [0]")
    parser.add_argument("--no-pytest", action="store_true", help="skip the pytest run")
    args = parser.parse_args(argv)
    from kvpool.store_node.tiers.gpu import probe_gpu

    reason = probe_gpu(args.device)
    if reason is not None:
        print(f"gpu_check: no usable GPU here: {reason}")
        print("gpu_check: nothing checked (exit 2)")
        return 2
    failures = 0
    with tempfile.TemporaryDirectory(prefix="kvpool-gpu-check-") as tmp:
        directory = Path(tmp)
        promotion: list[str] = []

        def promo() -> str:
            a, b = check_promotion_and_demotion(args.device, directory / "pd")
            promotion.append(b)
            return a

        checks: list[tuple[str, Callable[[], str]]] = [
            ("probe", lambda: check_probe(args.device)),
            ("tier_roundtrip", lambda: check_tier_roundtrip(args.device)),
            ("promotion", promo),
            ("demotion", lambda: promotion[0] if promotion else "skipped: promotion failed"),
            ("data_plane", lambda: check_data_plane(args.device, directory / "dp")),
        ]
        if not args.no_pytest:
            checks.append(("pytest", check_pytest))
        for name, check in checks:
            started = time.perf_counter()
            try:
                detail = check()
            except Exception as e:
                failures += 1
                print(f"FAIL {name}: {e}")
                traceback.print_exc()
                continue
            print(f"ok   {name} ({time.perf_counter() - started:.2f}s): {detail}")
    print(f"gpu_check: {len(checks) - failures} of {len(checks)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
