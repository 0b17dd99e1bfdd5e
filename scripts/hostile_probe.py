"""Issue 16's attacks against a local cluster, measured: what each numbered finding does now.

    .venv/bin/python scripts/hostile_probe.py [--fuzz-inputs 300] [--json]

Starts 3 masters + 2 nodes (256 MiB CPU tiers, no cluster token: every port reachable from
loopback, as the probe that filed the issue had it), puts known blocks, then per finding runs
the attack and prints what happened (memory is ``RssAnon``: the process's own heap; a node's
VmRSS also counts its shared-memory tier). Ends with the fuzz suite at every port (memory of
each process before and after), the known blocks read back, and ``cluster down`` timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

import grpc

from kvpool.grpcutil import PROTOCOL_METADATA
from kvpool.launcher.cluster import LocalCluster
from kvpool.launcher.procfs import process_start_ticks, same_process
from kvpool.proto.v1 import master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.proto.wire import Header, Op
from tests.hostile_cluster import (
    KnownBlocks,
    alive,
    attack_all,
    memory,
    ports,
    rss_mib,
    shm_name,
)
from tests.integration.test_fuzz_ports import _inputs

MIB = 1 << 20


def hostport(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return host.strip("[]"), int(port)


def wait_closed(sock: socket.socket, timeout_s: float) -> float | None:
    started = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - started < timeout_s:
        try:
            if sock.recv(1 << 16) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


def master_status(address: str) -> master_pb2.ClusterStatusResponse:
    with grpc.insecure_channel(address) as channel:
        return master_pb2_grpc.MasterStub(channel).ClusterStatus(
            master_pb2.ClusterStatusRequest(), timeout=2.0, metadata=PROTOCOL_METADATA
        )


def leader_of(cluster: LocalCluster) -> tuple[str, Any]:
    address = cluster.wait_for_leader()
    name = cluster.name_of_master(address)
    return name, cluster.processes[name]


def rpc_address(info: Any) -> tuple[str, int]:
    doc = json.loads(Path(info.ready_file).read_text())
    return hostport(str(doc["rpc"]))


def finding_1(cluster: LocalCluster) -> dict[str, Any]:
    """RPC headers declaring 64 MiB; MGET tables never sent; 500 connect-and-drop cycles; 2,000
    silent connections to the leader's read port."""
    name, master = leader_of(cluster)
    node = cluster.nodes[0]
    out: dict[str, Any] = {"master": name}
    before_m, before_n = rss_mib(master.pid), rss_mib(node.pid)
    for _ in range(2):
        socks = []
        for _ in range(6):
            s = socket.create_connection(rpc_address(master))
            s.sendall(Header(op=Op.RPC, payload_len=64 * MIB, key_len=6).pack() + b"Lookup")
            socks.append(s)
        out.setdefault("rpc_64MiB_closed_after_s", []).append(
            round(max(wait_closed(s, 5.0) or 99 for s in socks), 3)
        )
        for s in socks:
            s.close()
    socks = []
    for _ in range(6):
        s = socket.create_connection(hostport(node.data))
        s.sendall(Header(op=Op.MGET, payload_len=4 * MIB).pack())
        socks.append(s)
    out["mget_table_never_sent_cut_after_s"] = round(
        max(wait_closed(s, 10.0) or 99 for s in socks), 3
    )
    for s in socks:
        s.close()
    time.sleep(0.3)
    out["master_rssanon_mib"] = [round(before_m, 1), round(rss_mib(master.pid), 1)]
    out["node_rssanon_mib"] = [round(before_n, 1), round(rss_mib(node.pid), 1)]
    before = memory(cluster)
    for port in ports(cluster):
        if port.family != socket.AF_INET:
            continue
        for _ in range(500 // 4):
            with socket.create_connection(port.address, timeout=2.0):  # type: ignore[arg-type]
                pass
    time.sleep(0.5)
    out["500_connect_drop_rssanon_mib"] = {k: [before[k], v] for k, v in memory(cluster).items()}
    out["read_port_idle_flood"] = idle_flood(master.pid, read_address(master), 2000)
    return out


def read_address(info: Any) -> tuple[str, int]:
    doc = json.loads(Path(info.ready_file).read_text())
    return hostport(str(doc["read"]))


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def idle_flood(pid: int, address: tuple[str, int], n: int) -> dict[str, Any]:
    """``n`` connections to a master's read port that never send: its threads and heap while
    they are open (beyond ``read_threads`` they are closed at once) and after they close."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    before = rss_mib(pid)
    socks = [socket.create_connection(address, timeout=2.0) for _ in range(n)]
    time.sleep(1.0)
    during, threads = rss_mib(pid), threads_of(pid)
    closed = sum(1 for s in socks if _closed_by_peer(s))
    for s in socks:
        s.close()
    time.sleep(1.0)
    return {
        "connections": n,
        "closed_at_once": closed,
        "master_threads_while_open": threads,
        "rssanon_mib": [round(before, 1), round(during, 1), round(rss_mib(pid), 1)],
    }


def finding_2(cluster: LocalCluster) -> dict[str, Any]:
    """CopyBlocks naming two 1 GiB blocks, empty and over-long keys, sizes 2^40 and 2^64-1."""
    node = cluster.nodes[0]
    target = cluster.nodes[1].data
    out: dict[str, Any] = {}
    cases = {
        "two_1GiB_refs": [
            node_pb2.BlockRef(key=f"k{i}", write_id=1, size_bytes=1 << 30) for i in range(2)
        ],
        "empty_key": [node_pb2.BlockRef(key="", write_id=1, size_bytes=10)],
        "long_key": [node_pb2.BlockRef(key="k" * 2000, write_id=1, size_bytes=10)],
        "size_2^40": [node_pb2.BlockRef(key="k", write_id=1, size_bytes=1 << 40)],
        "size_2^64-1": [node_pb2.BlockRef(key="k", write_id=1, size_bytes=2**64 - 1)],
    }  # fmt: skip
    before = rss_mib(node.pid)
    with grpc.insecure_channel(node.grpc) as channel:
        stub = node_pb2_grpc.NodeAdminStub(channel)
        for case, refs in cases.items():
            started = time.monotonic()
            try:
                stub.CopyBlocks(
                    node_pb2.CopyBlocksRequest(target_data_address=target, blocks=refs),
                    timeout=10,
                    metadata=PROTOCOL_METADATA,
                )
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            out[case] = {"status": code, "ms": round((time.monotonic() - started) * 1e3, 1)}
    out["node_rssanon_mib"] = [round(before, 1), round(rss_mib(node.pid), 1)]
    return out


def finding_3(cluster: LocalCluster) -> dict[str, Any]:
    """One unauthenticated connection streaming 48 MiB behind a 2 GiB length, 7 times."""
    name, leader = leader_of(cluster)
    term = master_status(leader.grpc).master.term
    before = rss_mib(leader.pid)
    cut_s = []
    host, port = hostport(leader.raft)
    for _ in range(7):
        s = socket.create_connection((host, port))
        s.sendall(struct.pack("i", 2**31 - 1))
        s.settimeout(0.5)
        started, sent = time.monotonic(), 0
        try:
            while sent < 48 * MIB:
                sent += s.send(b"\0" * 65536)
        except OSError:
            pass
        closed = wait_closed(s, 5.0)
        cut_s.append(round(time.monotonic() - started, 3) if closed is not None else None)
        s.close()
    silent = socket.create_connection((host, port))
    silent_cut = wait_closed(silent, 10.0)
    silent.close()
    time.sleep(1.0)
    status = master_status(leader.grpc).master
    return {
        "leader": name,
        "runs": 7,
        "leadership_kept": status.role == "leader",
        "elections": status.term - term,
        "cut_after_s": cut_s,
        "silent_unauthenticated_cut_after_s": silent_cut and round(silent_cut, 2),
        "leader_rssanon_mib": [round(before, 1), round(rss_mib(leader.pid), 1)],
    }


def finding_4(cluster: LocalCluster, known: KnownBlocks) -> dict[str, Any]:
    """A raw PUT + PUBLISH of version 2^64-1 of a key on every node, then a client put of it."""
    from kvpool.checksum import block_checksum

    answers = []
    for node in cluster.nodes:
        with socket.create_connection(hostport(node.data)) as s:
            data, key = b"poison", b"victim"
            s.sendall(
                Header(op=Op.PUT, request_id=1, write_id=666, payload_len=len(data),
                       checksum=block_checksum(data), key_len=len(key)).pack() + key + data
                + Header(op=Op.PUBLISH, request_id=2, write_id=666, version=2**64 - 1,
                         key_len=len(key)).pack() + key
            )  # fmt: skip
            s.settimeout(3)
            raw = b""
            while len(raw) < 112:
                chunk = s.recv(4096)
                if not chunk:
                    break
                raw += chunk
            answers.append(raw[56 + 7] if len(raw) >= 112 else -1)  # the PUBLISH's status
    with known.client() as kv:
        put_ok = kv.put("victim", b"the real value")
        got = kv.get("victim")
    return {
        "forged_publish_status": answers,  # 1 = MISS (refused: the index names no such write)
        "later_put": put_ok,
        "read_back_exact": got == b"the real value",
    }


def finding_5(cluster: LocalCluster, known: KnownBlocks) -> dict[str, Any]:
    """Three PUT headers of 64 MiB with no payload, then a fourth PUT."""
    node = cluster.nodes[0]

    def evictions() -> int:
        with grpc.insecure_channel(node.grpc) as channel:
            stats = node_pb2_grpc.NodeAdminStub(channel).GetStats(
                node_pb2.GetStatsRequest(), timeout=2, metadata=PROTOCOL_METADATA
            )
        return int(stats.evictions_total)

    ev_before = evictions()
    same_before, total = known.read_back()
    socks = []
    for i in range(3):
        s = socket.create_connection(hostport(node.data))
        key = f"hold{i}".encode()
        s.sendall(
            Header(op=Op.PUT, write_id=5, payload_len=64 * MIB, key_len=len(key)).pack() + key
        )
        socks.append(s)
    time.sleep(0.2)
    fourth = socket.create_connection(hostport(node.data))
    key = b"fourth"
    fourth.sendall(Header(op=Op.PUT, write_id=5, payload_len=60 * MIB, key_len=6).pack() + key)
    with contextlib.suppress(OSError):
        fourth.sendall(b"\0" * (60 * MIB))
    fourth.settimeout(5)
    head = fourth.recv(56)
    fourth_status = head[7] if len(head) >= 8 else -1
    cut = [wait_closed(s, 10.0) for s in socks]
    for s in [*socks, fourth]:
        s.close()
    same_after, _ = known.read_back()
    return {
        "silent_puts_cut_after_s": [c and round(c, 2) for c in cut],
        "fourth_put_status": fourth_status,  # 2 = NO_SPACE (any refusal is fine), 0 = staged
        "evictions_caused": evictions() - ev_before,
        "known_blocks_read_back": [same_before, same_after, total],
    }


def finding_6(cluster: LocalCluster, known: KnownBlocks) -> dict[str, Any]:
    """RegisterNode with data_address 'not-an-address' and capacity 2^64-1; puts meanwhile."""
    leader = cluster.wait_for_leader()
    out: dict[str, Any] = {}
    with grpc.insecure_channel(leader) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        cases: dict[str, dict[str, Any]] = {
            "bad_address": {"data_address": "not-an-address", "capacity_bytes": 1 << 30},
            "capacity_2^64-1": {"data_address": "tcp://127.0.0.1:9", "capacity_bytes": 2**64 - 1},
        }
        for case, fields in cases.items():
            try:
                stub.RegisterNode(
                    master_pb2.RegisterNodeRequest(
                        request_id=os.urandom(16), node_id="fake", incarnation=1, **fields
                    ),
                    timeout=5,
                    metadata=PROTOCOL_METADATA,
                )
                out[case] = "OK (accepted!)"
            except grpc.RpcError as e:
                out[case] = e.code().name
    failures = 0
    deadline = time.monotonic() + 3.3
    with known.client() as kv:
        i = 0
        while time.monotonic() < deadline:
            ok = kv.put(f"during6/{i}", b"x" * 1000) and kv.get(f"during6/{i}") == b"x" * 1000
            failures += not ok
            i += 1
    out["puts_and_gets_in_3.3s"] = i
    out["failed"] = failures
    return out


def finding_7(cluster: LocalCluster) -> dict[str, Any]:
    """A Lookup of 10^6 keys; the largest accepted one (max_lookup_keys) timed."""
    leader = cluster.wait_for_leader()
    out: dict[str, Any] = {}
    with grpc.insecure_channel(leader) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for n, form in ((10**6, "kv1/model/{:032x}"), (10**6, "{:x}"), (16384, "kv1/model/{:032x}"),
                        (4096, "kv1/model/{:032x}")):  # fmt: skip
            keys = [form.format(i) for i in range(n)]
            started = time.monotonic()
            try:
                stub.Lookup(
                    master_pb2.LookupRequest(keys=keys), timeout=30, metadata=PROTOCOL_METADATA
                )
                status = "OK"
            except grpc.RpcError as e:
                status = e.code().name
            out[f"lookup_{n}_keys_of_{len(keys[-1])}_chars"] = {
                "status": status,
                "ms": round((time.monotonic() - started) * 1e3, 1),
            }
    # The loop's responsiveness while the largest accepted lookups run: a ping's worst latency.
    stop = threading.Event()
    worst = [0.0]

    def ping() -> None:
        with grpc.insecure_channel(leader) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            while not stop.is_set():
                t = time.monotonic()
                stub.GetMembers(
                    master_pb2.GetMembersRequest(), timeout=5, metadata=PROTOCOL_METADATA
                )
                worst[0] = max(worst[0], time.monotonic() - t)
                time.sleep(0.005)

    thread = threading.Thread(target=ping)
    thread.start()
    with grpc.insecure_channel(leader) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        keys = [f"kv1/model/{i:032x}" for i in range(16384)]
        for _ in range(5):
            stub.Lookup(master_pb2.LookupRequest(keys=keys), timeout=30, metadata=PROTOCOL_METADATA)
    stop.set()
    thread.join()
    out["worst_other_call_ms_during_16384_key_lookups"] = round(worst[0] * 1e3, 1)
    return out


def finding_8(cluster: LocalCluster) -> dict[str, Any]:
    """250 shm connect-and-close per node; 785 undecodable gRPC requests; log lines counted."""
    for node in cluster.nodes:
        name = shm_name(node.data)
        for _ in range(250):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            s.close()
    leader = cluster.wait_for_leader()
    with grpc.insecure_channel(leader) as channel:
        call = channel.unary_unary("/kvpool.v1.Master/Lookup")
        for i in range(785):
            with contextlib.suppress(grpc.RpcError):
                call(bytes([0xFF, i % 256, 0x01]), timeout=2, metadata=PROTOCOL_METADATA)
    time.sleep(0.5)
    counts = {}
    for info in cluster.processes.values():
        log = Path(info.log).read_text(errors="replace")
        counts[info.name] = {
            "Traceback": log.count("Traceback"),
            "Exception in callback": log.count("Exception in callback"),
            "rpc_bad_request": log.count("rpc_bad_request"),
            "shm_peer_left": log.count("shm_peer_left"),
        }
    return counts


def finding_9(cluster: LocalCluster) -> dict[str, Any]:
    """`cluster down`: does it return only when every process has exited?"""
    ticks = {n: (i.pid, process_start_ticks(i.pid)) for n, i in cluster.processes.items()}
    started = time.monotonic()
    cluster.stop()
    took = time.monotonic() - started
    still = [n for n, (pid, t) in ticks.items() if same_process(pid, t)]
    return {"down_s": round(took, 2), "still_running_when_it_returned": still}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-inputs", type=int, default=300, help="fuzz inputs per port")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvpool-hostile-"))
    cluster = LocalCluster(base, masters=3, nodes=2, cpu_cache_size="256MiB", metrics=True)
    cluster.start()
    report: dict[str, Any] = {}
    try:
        known = KnownBlocks(cluster)
        known.put()
        for n, run in enumerate(
            [
                lambda: finding_1(cluster),
                lambda: finding_2(cluster),
                lambda: finding_3(cluster),
                lambda: finding_4(cluster, known),
                lambda: finding_5(cluster, known),
                lambda: finding_6(cluster, known),
                lambda: finding_7(cluster),
                lambda: finding_8(cluster),
            ],
            start=1,
        ):
            report[f"finding_{n}"] = run()
            if not args.json:
                print(f"finding {n}: {json.dumps(report[f'finding_{n}'])}", flush=True)
        before = memory(cluster)
        started = time.monotonic()
        sent = attack_all(cluster, _inputs(args.fuzz_inputs, 16), deadline_s=1800)
        report["fuzz"] = {
            "inputs_per_port": sent,
            "seconds": round(time.monotonic() - started, 1),
            "rssanon_mib_before": before,
            "rssanon_mib_after": memory(cluster),
            "alive": alive(cluster),
            "known_blocks_read_back": known.read_back(),
        }
        if not args.json:
            print(f"fuzz: {json.dumps(report['fuzz'])}", flush=True)
    finally:
        report["finding_9"] = finding_9(cluster)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"finding 9: {json.dumps(report['finding_9'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
