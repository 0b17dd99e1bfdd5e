"""Before/after speed of the client: two revisions' clients, one cluster, interleaved rounds.

    python scripts/client_ab.py --before 3c73a6a              # that revision vs the work tree
    python scripts/client_ab.py --before v1 --after v2 --rounds 16 --calls 600

Each revision is checked out (``git worktree``, under a temporary folder, removed at the end)
and mirrored as an installed package tree (``.ci/linktree.py``); each round runs every
revision's client in a fresh process (``PYTHONPATH`` = that tree), the order alternating round
by round, against one local cluster of the work tree (3 masters, 2 nodes) — over tcp, then over
shared memory. Per cell a process reports the p50 and the p10 of its calls; the table gives the
median over rounds of each, and after/before. Only the clients differ: the servers are the same
processes for both.

The cells: a 4 KiB ``get`` with its entry cached and never cached (a fresh client with
``lookup_cache_size=0``), the first ``get`` of a key the client has just put, a 1 MiB
``get_into``, a 1 MiB and a 4 MiB ``get``, ``batch_get`` and ``batch_get_into`` of 32 x 1 MiB
(the latter for both clients), ``batch_get`` and ``batch_get_into`` of 32 x 64 KiB, a 4 KiB
and a 1 MiB ``put``, ``batch_put`` of 32 x 1 MiB, ``exists``, a cached 4 KiB ``get`` of a
block on 2 replicas (a read that may hedge, both clients), the AsyncClient's cached 4 KiB
``get``, its 4 KiB and 1 MiB ``put``, and (once per round, listed under tcp) the
client's own Python per get with the network faked away — the data plane, and for a never-cached
get the master call too; then a cached ``get_into`` with only its connection's socket faked (a
node's real answer replayed) — the best of 5 runs, the cells that do not move with the machine's
load.
A revision whose client lacks ``kvpool.Client`` / ``AsyncClient`` cannot be measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("tcp", "shm")
GIT = shutil.which("git") or "/usr/bin/git"


def _worker(masters: list[str], transport: str, n: int, tag: str) -> dict[str, float]:
    """One revision's cells (runs in the child process, under that revision's tree)."""
    from kvpool import AsyncClient, Client

    out: dict[str, float] = {}

    def cell(name: str, samples: list[float]) -> None:
        samples.sort()
        out[name] = samples[len(samples) // 2] * 1e6
        out[name + " [p10]"] = samples[len(samples) // 10] * 1e6

    def timed(name: str, fn: Any, reps: int) -> None:
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        cell(name, samples)

    small, mid, big, huge = b"s" * 4096, b"m" * 65536, os.urandom(1 << 20), os.urandom(4 << 20)
    pre = f"ab-{tag}-{transport}-{time.time_ns()}"
    kv = Client(masters, transport=transport)
    try:
        assert kv.put(f"{pre}-s", small)
        assert kv.put(f"{pre}-b", big)
        keys32 = [f"{pre}-m{i}" for i in range(32)]
        assert all(kv.batch_put([(k, mid) for k in keys32]))
        for _ in range(20):
            kv.get(f"{pre}-s")
        timed("get 4 KiB, entry cached", lambda: kv.get(f"{pre}-s"), n)
        fresh = [f"{pre}-u{i}" for i in range(max(30, n // 3))]
        assert all(kv.batch_put([(k, small) for k in fresh]))
        uncached = Client(masters, transport=transport, lookup_cache_size=0)
        try:
            it = iter(fresh)
            timed("get 4 KiB, never cached", lambda: uncached.get(next(it)), len(fresh))
        finally:
            uncached.close()
        samples = []
        for i in range(max(30, n // 3)):  # read back what it just put, as an engine does
            assert kv.put(f"{pre}-o{i}", small)
            t = time.perf_counter()
            kv.get(f"{pre}-o{i}")
            samples.append(time.perf_counter() - t)
        cell("get 4 KiB, its own put, first read", samples)
        buf = bytearray(1 << 20)
        timed("get_into 1 MiB", lambda: kv.get_into(f"{pre}-b", buf), max(20, n // 5))
        timed("get 1 MiB", lambda: kv.get(f"{pre}-b"), max(20, n // 5))
        assert kv.put(f"{pre}-h", huge)
        timed("get 4 MiB", lambda: kv.get(f"{pre}-h"), max(20, n // 10))
        big32 = [f"{pre}-g{i}" for i in range(32)]
        assert all(kv.batch_put([(k, big) for k in big32]))
        timed("batch_get 32 x 1 MiB", lambda: kv.batch_get(big32), max(10, n // 20))
        bigbufs = [bytearray(1 << 20) for _ in range(32)]
        timed(
            "batch_get_into 32 x 1 MiB",
            lambda: kv.batch_get_into(big32, bigbufs),
            max(10, n // 20),
        )
        timed("batch_get 32 x 64 KiB", lambda: kv.batch_get(keys32), max(20, n // 10))
        bufs = [bytearray(65536) for _ in range(32)]
        timed(
            "batch_get_into 32 x 64 KiB", lambda: kv.batch_get_into(keys32, bufs), max(20, n // 10)
        )
        count = iter(range(1 << 62))
        timed("put 4 KiB", lambda: kv.put(f"{pre}-p{next(count)}", small), max(30, n // 3))
        timed("put 1 MiB", lambda: kv.put(f"{pre}-p{next(count)}", big), max(20, n // 5))
        batches = iter(range(1 << 62))

        def batch_put() -> None:
            b = next(batches)
            assert all(kv.batch_put([(f"{pre}-q{b}-{i}", big) for i in range(32)]))

        timed("batch_put 32 x 1 MiB", batch_put, max(10, n // 30))
        timed("exists", lambda: kv.exists(f"{pre}-s"), n)
    finally:
        kv.close()
    with Client(masters, transport=transport, replicas=2) as twice:  # a read that may hedge
        assert twice.put(f"{pre}-r", small)
        for _ in range(20):
            twice.get(f"{pre}-r")
        timed("get 4 KiB, 2 replicas, cached", lambda: twice.get(f"{pre}-r"), n)

    async def atimed(name: str, fn: Any, reps: int) -> None:
        samples = []
        for i in range(reps):
            t = time.perf_counter()
            await fn(i)
            samples.append(time.perf_counter() - t)
        cell(name, samples)

    async def async_cells() -> None:
        async with AsyncClient(masters, transport=transport) as ak:
            for _ in range(10):
                await ak.get(f"{pre}-s")
            await atimed("AsyncClient get 4 KiB, cached", lambda _: ak.get(f"{pre}-s"), n)
            put = lambda i: ak.put(f"{pre}-ap{i}", small)  # noqa: E731
            await atimed("AsyncClient put 4 KiB", put, max(30, n // 3))
            put = lambda i: ak.put(f"{pre}-aq{i}", big)  # noqa: E731
            await atimed("AsyncClient put 1 MiB", put, max(20, n // 5))
            bigbufs = [bytearray(1 << 20) for _ in range(32)]
            batch = lambda _: ak.batch_get_into(big32, bigbufs)  # noqa: E731
            await atimed("AsyncClient batch_get_into 32 x 1 MiB", batch, max(10, n // 20))
        async with AsyncClient(masters, transport=transport, replicas=2) as ak:
            for _ in range(10):
                await ak.get(f"{pre}-r")
            get = lambda _: ak.get(f"{pre}-r")  # noqa: E731
            await atimed("AsyncClient get 4 KiB, 2 replicas, cached", get, n)

    asyncio.run(async_cells())
    with Client(masters) as kv, contextlib.suppress(AttributeError):
        while kv.remove_prefix(pre)[1]:  # the rounds' blocks would fill the nodes (evictions)
            pass
    if transport == "tcp":  # no transport involved: measured once per round
        out.update(_python_only())
        out.update(_python_through_the_data_plane(masters))
    return out


class _Replay:
    """A connection's socket that answers every request with ``answer`` (the bytes a node sent
    for one such request), its request id set to the request's: the client's whole read path
    runs, the network does not."""

    def __init__(self, real: Any, answer: bytes) -> None:
        from kvpool.proto.wire import HEADER_SIZE, unpack_header

        self._real, self._answer, self._out, self._at = real, answer, b"", 0
        self._size, self._unpack = HEADER_SIZE, unpack_header
        self._header = unpack_header(answer[:HEADER_SIZE])

    def sendmsg(self, views: list[Any]) -> int:
        sent = b"".join(bytes(v) for v in views)
        asked = self._unpack(sent[: self._size])
        head = self._header._replace(request_id=asked.request_id).pack()[: self._size]
        self._out, self._at = head + self._answer[self._size :], 0
        return len(sent)

    def recv_into(self, view: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(view)
        n = min(nbytes or view.nbytes, len(self._out) - self._at)
        view[:n] = self._out[self._at : self._at + n]
        if not flags:  # MSG_PEEK leaves the bytes there
            self._at += n
        return n

    def setsockopt(self, *_: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Tap:
    """A socket that keeps a copy of what it receives."""

    def __init__(self, real: Any) -> None:
        self.real, self.got = real, bytearray()

    def recv_into(self, view: Any, nbytes: int = 0, flags: int = 0) -> int:
        n = int(self.real.recv_into(view, nbytes, flags))
        if not flags:
            self.got += bytes(memoryview(view)[:n])
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _python_through_the_data_plane(masters: list[str]) -> dict[str, float]:
    """The client's own Python per cached 4 KiB ``get_into``, down through the data plane and
    the blocking connection: only the socket is faked (a node's real answer, recorded once,
    replayed with each request's id); the best of 5 x 20,000 calls, in µs. Reaches into the
    client's internals (``_data._conns``, a connection's ``_sock``): none where they differ."""
    from kvpool import Client

    kv = Client(masters, transport="tcp", hedge_reads=False)
    try:
        key, buf = f"ab-replay-{time.time_ns()}", bytearray(4096)
        assert kv.put(key, b"r" * 4096)
        assert kv.get_into(key, buf) == 4096  # the entry cached, the connection open
        (conn,) = kv._data._conns.of_this_thread().values()
        tap = conn._sock = _Tap(conn._sock)
        assert kv.get_into(key, buf) == 4096
        conn._sock = _Replay(tap.real, bytes(tap.got))
        if kv.get_into(key, buf) != 4096:
            return {}
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20_000):
                kv.get_into(key, buf)
            best = min(best, (time.perf_counter() - t) / 20_000)
        conn._sock = tap.real
        kv.remove(key)
        return {"Python only: get_into, socket replayed": best * 1e6}
    except (AttributeError, ValueError):
        return {}
    finally:
        kv.close()


def _python_only() -> dict[str, float]:
    """The client's own Python per get, without the network: the data plane faked (a read
    fills the item in place), and for a never-cached get the master call faked too (a canned
    Lookup answer); the best of 5 x 20,000 calls, in µs. Reaches into the client's internals
    (``_data``, ``_masters``; under ``_path`` in older revisions): none where they differ."""
    from kvpool import Client
    from kvpool.proto.v1 import common_pb2, master_pb2

    entry = common_pb2.BlockEntry(
        key="k", found=True, version=1, write_id=7, size_bytes=4, replicas=[1]
    )
    member = common_pb2.Member(member_id=1, node_id="n1", data_address="tcp://127.0.0.1:9")
    wire = master_pb2.LookupResponse(entries=[entry], members=[member], revision=3)
    answer = wire.SerializeToString()

    class Masters:
        def call(self, method: str, request: Any, *, deadline: float, **_: Any) -> Any:
            request.SerializeToString()
            return master_pb2.LookupResponse.FromString(answer)

        def close(self) -> None:
            pass

    def read(items: list[Any], members: Any, deadline: float, on_retry: Any = None) -> None:
        for it in items:
            members(it.replicas[0])
            it.ok, it.value = True, b"data"

    out: dict[str, float] = {}
    for name, cache_size in (("cached", 4096), ("never cached", 0)):
        kv = Client(["127.0.0.1:1"], transport="tcp", timeout_s=2.0, lookup_cache_size=cache_size)
        try:
            inner = getattr(kv, "_path", kv)
            inner._data.read = read
            inner._masters = Masters()
            if kv.get("k") != b"data":
                continue
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20_000):
                    kv.get("k")
                best = min(best, (time.perf_counter() - t) / 20_000)
            out[f"Python only: get, {name}"] = best * 1e6
        except AttributeError:
            continue
        finally:
            kv.close()
    return out


def _tree(rev: str | None, work: Path, name: str) -> Path:
    """The package tree of ``rev`` (None: the work tree as it is)."""
    source = ROOT
    if rev is not None:
        source = work / f"src-{name}"
        subprocess.run(
            [GIT, "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(source), rev],
            check=True,
        )
    tree = work / f"tree-{name}"
    subprocess.run(
        [sys.executable, str(source / ".ci" / "linktree.py"), str(tree)],  # rev's own mapping
        check=True,
        cwd=work,
        stdout=subprocess.DEVNULL,
    )
    return tree


def _one(env: dict[str, str], cwd: Path, worker: list[str]) -> dict[str, float] | None:
    """One revision's cells in a fresh process (None: it failed; its error is printed)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--before", "-", "--worker", *worker]
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return None
    cells: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--before", required=True, help="the revision measured as 'before'")
    parser.add_argument("--after", help="the revision measured as 'after' [the work tree]")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds [10]")
    parser.add_argument("--calls", type=int, default=600, help="calls per cell and round [600]")
    parser.add_argument("--json", type=Path, help="also write every round's numbers here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        masters, transport, n, tag = args.worker
        print(json.dumps(_worker(masters.split(","), transport, int(n), tag)))
        return 0
    if args.rounds < 1 or args.calls < 10:
        parser.error("--rounds must be at least 1 and --calls at least 10")

    from kvpool.launcher.cluster import LocalCluster

    raw: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in TRANSPORTS}
    with tempfile.TemporaryDirectory(prefix="kvpool-ab-") as tmp:
        work = Path(tmp)
        trees: dict[str, Path] = {}
        try:
            trees = {
                "before": _tree(args.before, work, "before"),
                "after": _tree(args.after, work, "after"),
            }
            cluster = LocalCluster(work / "cluster", masters=3, nodes=2, cpu_cache_size="1GiB")
            try:
                cluster.start()
                cluster.wait_for_leader()
                masters = ",".join(cluster.client_master_addresses)
                for r in range(args.rounds):
                    for transport in TRANSPORTS:
                        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                        for who in order:
                            env = dict(os.environ, **cluster.client_env)
                            env.update(PYTHONPATH=str(trees[who]), PYTHONSAFEPATH="1")
                            cells = _one(env, work, [masters, transport, str(args.calls), who])
                            if cells is None:
                                print(f"the {who} client failed (round {r + 1}, {transport})")
                                return 1
                            for name, value in cells.items():
                                by = raw[transport].setdefault(name, {})
                                by.setdefault(who, []).append(value)
                    print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            finally:
                for name in list(cluster.processes):
                    cluster.terminate(name)
        finally:
            for name in ("before", "after"):
                source = work / f"src-{name}"
                if source.exists():
                    subprocess.run(
                        [GIT, "-C", str(ROOT), "worktree", "remove", "--force", str(source)],
                        check=False,
                    )
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    after = args.after or "work tree"
    print(f"before: {args.before}, after: {after}; {args.rounds} rounds x {args.calls} calls")
    print("| transport | cell | before µs | after µs | after/before |")
    print("|---|---|---|---|---|")
    for transport, cells in raw.items():
        for name, by in cells.items():
            b, a = statistics.median(by["before"]), statistics.median(by["after"])
            digits = 1 if b < 100 else 0
            print(f"| {transport} | {name} | {b:.{digits}f} | {a:.{digits}f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
