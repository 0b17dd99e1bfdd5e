"""Every port of a local cluster, as an attacker sees it, and the checks after an attack: every
process alive, its memory, every known block read back exactly (issue 16). Used by the
integration fuzz test and ``scripts/hostile_probe.py``."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.wire import Header, Op
from tests.fuzzing import Port, send, shm_handshake


def rss_mib(pid: int, field: str = "RssAnon") -> float:
    """Resident memory of a process, MiB (0 when it is gone). ``RssAnon`` by default: the
    process's own heap — a node's ``VmRSS`` also counts the pages of its shared-memory CPU tier
    as they are prefaulted and filled, which says nothing about what an attack cost."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return 0.0
    return 0.0


def memory(cluster: LocalCluster, field: str = "RssAnon") -> dict[str, float]:
    return {name: round(rss_mib(info.pid, field), 1) for name, info in cluster.processes.items()}


def alive(cluster: LocalCluster) -> list[str]:
    return [name for name in cluster.processes if cluster.is_running(name)]


def _hostport(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def _ready(info_ready_file: str) -> dict[str, object]:
    try:
        doc = json.loads(Path(info_ready_file).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def shm_name(data_address: str, timeout_s: float = 2.0) -> str:
    """The node's shared-memory socket name, from its HELLO answer ("" when none)."""
    host, port = _hostport(data_address)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(Header(op=Op.HELLO, request_id=1).pack())
        head = b""
        while len(head) < 56:
            chunk = sock.recv(56 - len(head))
            if not chunk:
                return ""
            head += chunk
        length = struct.unpack_from("<Q", head, 32)[0]
        key_len = struct.unpack_from("<H", head, 48)[0]
        body = b""
        while len(body) < key_len + length:
            chunk = sock.recv(key_len + length - len(body))
            if not chunk:
                break
            body += chunk
    doc = json.loads(body[key_len:] or b"{}")
    shm = str(doc.get("shm", ""))
    return shm.removeprefix("shm://")


def ports(cluster: LocalCluster) -> list[Port]:
    """Every listening port of every process: masters' gRPC, Raft, frame RPC, read and /metrics;
    nodes' data port, shared-memory socket, admin gRPC and /metrics."""
    out: list[Port] = []
    inet = socket.AF_INET
    for info in cluster.masters:
        ready = _ready(info.ready_file)
        out.append(Port(f"{info.name} grpc", inet, _hostport(info.grpc), info.pid))
        out.append(Port(f"{info.name} raft", inet, _hostport(info.raft), info.pid))
        if ready.get("rpc"):
            out.append(Port(f"{info.name} rpc", inet, _hostport(str(ready["rpc"])), info.pid))
        if ready.get("read"):
            out.append(Port(f"{info.name} read", inet, _hostport(str(ready["read"])), info.pid))
        if info.extra.get("metrics"):
            out.append(
                Port(f"{info.name} metrics", inet, _hostport(info.extra["metrics"]), info.pid)
            )
    for info in cluster.nodes:
        out.append(Port(f"{info.name} data", inet, _hostport(info.data), info.pid))
        out.append(Port(f"{info.name} admin", inet, _hostport(info.grpc), info.pid))
        if info.extra.get("metrics"):
            out.append(
                Port(f"{info.name} metrics", inet, _hostport(info.extra["metrics"]), info.pid)
            )
        name = shm_name(info.data)
        if name:
            out.append(Port(f"{info.name} shm", socket.AF_UNIX, name, info.pid, shm_handshake))
    return out


def grpc_junk(port: Port, payloads: list[bytes]) -> int:
    """Well-formed gRPC calls whose request bytes are junk, to every kvpool method of a gRPC
    port; how many were answered (with an error, as they must be)."""
    assert isinstance(port.address, tuple)
    host, number = port.address
    methods = (
        ["Lookup", "CommitPuts", "RegisterNode", "Heartbeat", "PrefixMatch"]
        if "grpc" in port.name
        else ["GetStats", "CopyBlocks", "UpdateBlocks"]
    )
    service = "kvpool.v1.Master" if "grpc" in port.name else "kvpool.v1.NodeAdmin"
    answered = 0
    with grpc.insecure_channel(f"{host}:{number}") as channel:
        for i, payload in enumerate(payloads):
            call = channel.unary_unary(f"/{service}/{methods[i % len(methods)]}")
            with contextlib.suppress(grpc.RpcError):
                call(payload, timeout=2.0, metadata=(("kvpool-protocol-version", "1"),))
            answered += 1
    return answered


class KnownBlocks:
    """Blocks put before an attack, to read back byte for byte after it."""

    def __init__(self, cluster: LocalCluster, count: int = 64, seed: int = 16) -> None:
        self.cluster = cluster
        rng = random.Random(seed)
        self.values = {f"known/{i}": rng.randbytes(rng.randint(1, 64 << 10)) for i in range(count)}

    def client(self) -> Client:
        return Client(self.cluster.client_master_addresses, timeout_s=5.0, transport="tcp")

    def put(self) -> None:
        with self.client() as kv:
            results = kv.batch_put(self.values)
            assert all(results), f"{results.count(False)} known puts failed"

    def read_back(self) -> tuple[int, int]:
        """(identical, total)."""
        with self.client() as kv:
            got = kv.batch_get(list(self.values))
        same = sum(1 for v, g in zip(self.values.values(), got, strict=True) if g == v)
        return same, len(self.values)


def attack_all(
    cluster: LocalCluster,
    inputs: Callable[[str], list[bytes]],
    *,
    deadline_s: float,
) -> dict[str, int]:
    """Send each port its inputs (``inputs(port.name)``); how many went to each."""
    sent: dict[str, int] = {}
    stop = time.monotonic() + deadline_s
    for port in ports(cluster):
        count = 0
        for data in inputs(port.name):
            if time.monotonic() > stop:
                break
            send(port, data)
            count += 1
        if port.name.endswith(("grpc", "admin")):
            count += grpc_junk(port, inputs(port.name)[:20])
        sent[port.name] = count
    return sent
