"""Where one put's time goes, across the processes: the client, the Raft leader and followers.

Starts a local cluster (3 masters, 1 node, ``data_dir``), with probes in every master and in this
process that stamp events with ``time.perf_counter_ns()`` — ``CLOCK_MONOTONIC``, one clock for
every process on the host, so stamps of different processes compare. The masters get them
through a ``sitecustomize`` module on their ``PYTHONPATH``: PySyncObj's ``TCPTransport.send``
and ``_onMessageReceived``, ``SyncObj._onTick``, the RPC port's ``frame_received`` and ``_reply``,
``Replicator.propose`` and ``BlockIndex.apply``. The client's are its put steps (stage, commit,
publish). Then ``--puts`` sequential 4 KiB puts, and for each event the median of its offset
from its put's start over all but the first tenth of the puts ("#2": the event's second
occurrence within the commit). Probes cost ~5 % of a put.

    python scripts/put_timeline.py [--puts 1000] [--raft-tick loop|thread] [--show 1]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Loaded by each master (and imported here): stamps events into $KVTRACE/<pid>.tsv.
PROBES = r"""
import os
if os.environ.get("KVTRACE"):
    import atexit, builtins, sys, threading, time
    _events = []
    _out = os.path.join(os.environ["KVTRACE"], f"{os.getpid()}.tsv")

    def rec(tag):
        _events.append((time.perf_counter_ns(), tag))

    def flush():
        global _events
        taken, _events = _events, []
        if taken:
            with open(_out, "a") as f:
                f.write("".join(f"{t}\t{g}\n" for t, g in taken))

    def _flusher():
        while True:
            time.sleep(1.0)
            flush()

    threading.Thread(target=_flusher, daemon=True).start()
    atexit.register(flush)

    def _wrap(cls, name, make):
        current = cls.__dict__[name]
        if not getattr(current, "_probed", False):
            probe = make(current)
            probe._probed = True
            setattr(cls, name, probe)

    def _tagged(tag, end=None):
        def make(real):
            def probe(self, *a, **k):
                rec(tag)
                result = real(self, *a, **k)
                if end:
                    rec(end)
                return result
            return probe
        return make

    def _message(kind):
        def make(real):
            def probe(self, node, message, *a):
                entries = len(message.get("entries", ()) or ())
                rec(f"{kind}:{message.get('type')}:{entries}")
                result = real(self, node, message, *a)
                if kind == "send":
                    rec("sent")
                return result
            return probe
        return make

    def _frame(real):
        def probe(self, header, key, payload):
            rec("rpc_in:" + key.decode(errors="replace"))
            return real(self, header, key, payload)
        return probe

    def _raft():
        import pysyncobj.syncobj as S, pysyncobj.transport as T
        _wrap(T.TCPTransport, "send", _message("send"))
        _wrap(T.Transport, "_onMessageReceived", _message("recv"))
        _wrap(S.SyncObj, "_onTick", _tagged("tick", "tickend"))

    def _master():
        import kvpool.raft_master.index as I, kvpool.raft_master.replication as P
        import kvpool.raft_master.rpc_port as R
        _wrap(R.RpcConnection, "frame_received", _frame)
        _wrap(R.RpcConnection, "_reply", _tagged("rpc_reply", "rpc_replied"))
        _wrap(P.Replicator, "propose", _tagged("propose"))
        _wrap(I.BlockIndex, "apply", _tagged("apply", "applied"))

    _pending = {
        ("pysyncobj.syncobj", "pysyncobj.transport"): _raft,
        ("kvpool.raft_master.index", "kvpool.raft_master.replication",
         "kvpool.raft_master.rpc_port"): _master,
    }
    _import = builtins.__import__
    _busy = []

    def _probing_import(name, *a, **k):  # probes go in once their modules are imported
        module = _import(name, *a, **k)
        if _pending and not _busy:
            _busy.append(1)
            try:
                for needs, install in list(_pending.items()):
                    if all(n in sys.modules for n in needs):
                        try:
                            install()
                            del _pending[needs]
                        except Exception:
                            pass  # a module still being imported: next time
            finally:
                _busy.pop()
        return module

    builtins.__import__ = _probing_import
"""


def read_events(directory: Path) -> dict[int, list[tuple[int, str]]]:
    events: dict[int, list[tuple[int, str]]] = {}
    for path in directory.glob("*.tsv"):
        rows = []
        for line in path.read_text().splitlines():
            stamp, tag = line.split("\t", 1)
            rows.append((int(stamp), tag))
        events[int(path.stem)] = sorted(rows)
    return events


def _stamp(row: tuple[int, str]) -> int:
    return row[0]


def window(rows: list[tuple[int, str]], start: int, end: int) -> list[tuple[int, str]]:
    """The rows (sorted by stamp) stamped from ``start`` to ``end``."""
    return rows[
        bisect.bisect_left(rows, start, key=_stamp) : bisect.bisect_right(rows, end, key=_stamp)
    ]


def timeline(events: dict[int, list[tuple[int, str]]], client: int, show: int) -> None:
    commits = {pid: sum(g == "rpc_in:CommitPuts" for _, g in rows) for pid, rows in events.items()}
    leader = max((p for p in events if p != client), key=lambda p: commits[p])
    names = {client: "client", leader: "leader"}
    for i, pid in enumerate(p for p in sorted(events) if p not in names):
        names[pid] = f"follower {i + 1}"
    puts: list[dict[str, int]] = []
    current: dict[str, int] | None = None
    for stamp, tag in events[client]:
        if tag == "put":
            current = {"put": stamp}
        elif current is not None:
            current.setdefault(tag, stamp)
            if tag == "put_end":
                puts.append(current)
                current = None
    counted = puts[len(puts) // 10 :]
    offsets: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for put in counted:
        start = put["put"]
        for tag, stamp in put.items():
            offsets[("client", tag)].append(stamp - start)
        for pid, name in names.items():
            if pid == client:
                continue
            seen: collections.Counter[str] = collections.Counter()
            for stamp, tag in window(events[pid], put["commit"], put["commit_end"]):
                seen[tag] += 1
                label = tag if seen[tag] == 1 else f"{tag}#{seen[tag]}"
                offsets[(name, label)].append(stamp - start)
    rows = sorted(
        (statistics.median(v), who, tag, len(v))
        for (who, tag), v in offsets.items()
        if len(v) >= len(counted) / 2
    )
    print(f"{len(counted)} puts; µs from the put's start, medians (events seen in ≥ half)")
    for median, who, tag, n in rows:
        print(f"{median / 1e3:8.0f}  {who:11s} {tag:32s} n={n}")
    for put in counted[len(counted) // 2 : len(counted) // 2 + show]:
        print("--- one put")
        start = put["put"]
        merged = [
            (stamp, names[pid], tag)
            for pid in events
            for stamp, tag in window(events[pid], start, put["put_end"])
        ]
        for stamp, who, tag in sorted(merged):
            print(f"{(stamp - start) / 1e3:8.0f}  {who:11s} {tag}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--puts", type=int, default=1000, help="sequential 4 KiB puts [1000]")
    parser.add_argument(
        "--raft-tick", choices=("loop", "thread"), default="loop", help="raft_tick_on_loop [loop]"
    )
    parser.add_argument("--show", type=int, default=1, help="single puts to print whole [1]")
    args = parser.parse_args(argv)
    if args.puts < 20:
        parser.error("--puts: at least 20")
    with tempfile.TemporaryDirectory(prefix="kvpool-put-timeline-") as tmp:
        root = Path(tmp)
        probes, stamps = root / "probes", root / "stamps"
        probes.mkdir()
        stamps.mkdir()
        (probes / "sitecustomize.py").write_text(PROBES)
        os.environ["KVTRACE"] = str(stamps)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(probes), os.environ.get("PYTHONPATH", "")) if p
        )
        sys.path.insert(0, str(probes))
        import sitecustomize as probe  # type: ignore[import-not-found]  # the module just written

        from kvpool import Client
        from kvpool.client import blocking_plane, fastpath
        from kvpool.launcher.cluster import LocalCluster

        def stamp_around(cls: Any, name: str, tag: str) -> None:
            real = getattr(cls, name)

            def probed(*a: Any, **k: Any) -> Any:
                probe.rec(tag)
                result = real(*a, **k)
                probe.rec(tag + "_end")
                return result

            setattr(cls, name, probed)

        stamp_around(blocking_plane.BlockingDataPlane, "stage", "stage")
        stamp_around(fastpath.SyncPath, "_commit_rpc", "commit")
        stamp_around(blocking_plane.BlockingDataPlane, "send_refs", "publish")
        flags = ["--raft-tick-on-loop" if args.raft_tick == "loop" else "--no-raft-tick-on-loop"]
        cluster = LocalCluster(
            root / "cluster",
            masters=3,
            nodes=1,
            cpu_cache_size="256MiB",
            log_level="warning",
            extra_master_flags=flags,
        )
        try:
            cluster.start()
            with Client(cluster.master_addresses, transport="tcp") as kv:
                kv.warm_up()
                value, tag = os.urandom(4096), os.urandom(6).hex()
                latencies = []
                for i in range(args.puts):
                    probe.rec("put")
                    started = time.perf_counter_ns()
                    if not kv.put(f"kv1/{tag}/{i:032x}", value):
                        raise SystemExit(f"put {i} failed")
                    latencies.append(time.perf_counter_ns() - started)
                    probe.rec("put_end")
            probe.flush()
        finally:
            cluster.stop()
        p50_us = statistics.median(latencies) / 1e3
        print(f"put p50 {p50_us:.0f} µs (Raft ticked on {args.raft_tick})")
        timeline(read_events(stamps), os.getpid(), args.show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
