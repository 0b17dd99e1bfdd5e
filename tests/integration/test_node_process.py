"""A real `kvpool node` process against an in-process fake master (gRPC, honest and small).

Covers: registration (retried until the master answers), the ready file, GetStats, heartbeats,
known=False -> drop + re-register with a new incarnation, eviction reports, the staged reaper
(publish late / free), LeaveNode and exit status 0 on SIGTERM, exit 2 on bad config.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.checksum import block_checksum
from kvpool.grpcutil import create_channel, start_server, unary
from kvpool.proto.v1 import common_pb2, master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.proto.wire import Op, Status
from kvpool.transports.tcp import TcpConnection, parse_tcp_address

pytestmark = pytest.mark.integration


class FakeMaster(master_pb2_grpc.MasterServicer):
    def __init__(self) -> None:
        self.registrations: list[master_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[master_pb2.HeartbeatRequest] = []
        self.reports: list[master_pb2.ReportEvictionsRequest] = []
        self.leaves: list[master_pb2.LeaveNodeRequest] = []
        self.lookups: list[list[str]] = []
        self.index: dict[str, common_pb2.BlockEntry] = {}
        self.known = True
        self.refuse_registrations = 0

    async def RegisterNode(self, request: Any, context: Any) -> Any:
        if self.refuse_registrations:
            self.refuse_registrations -= 1
            from kvpool.errors import UnavailableError

            raise UnavailableError("no leader yet")
        self.registrations.append(request)
        self.known = True
        return master_pb2.RegisterNodeResponse(
            member_id=len(self.registrations), heartbeat_interval_s=0.1, node_timeout_s=1.0
        )

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        self.heartbeats.append(request)
        return master_pb2.HeartbeatResponse(known=self.known)

    async def ReportEvictions(self, request: Any, context: Any) -> Any:
        self.reports.append(request)
        return master_pb2.ReportEvictionsResponse(dropped=len(request.blocks))

    async def Lookup(self, request: Any, context: Any) -> Any:
        self.lookups.append(list(request.keys))
        return master_pb2.LookupResponse(
            entries=[self.index.get(k, common_pb2.BlockEntry(key=k)) for k in request.keys]
        )

    async def LeaveNode(self, request: Any, context: Any) -> Any:
        self.leaves.append(request)
        return master_pb2.LeaveNodeResponse()


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def node_process(
    config: dict[str, Any], log_path: Path
) -> AsyncIterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - opened once, before the node starts
        proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, not awaited here
            [sys.executable, "-m", "kvpool.store_node.server", "--config-json", json.dumps(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_node_registers_reaps_reports_reregisters_and_leaves(tmp_path: Path) -> None:
    async def scenario() -> None:
        fake = FakeMaster()  # type: ignore[abstract]  # a node calls only the methods defined
        fake.refuse_registrations = 2
        master = await start_server(
            "127.0.0.1:0",
            [(master_pb2_grpc.add_MasterServicer_to_server, fake, "kvpool.v1.Master")],
        )
        await master.set_ready(True)
        ready = tmp_path / "node.json"
        config = {
            "node_id": "n1",
            "masters": [f"127.0.0.1:{master.port}"],
            "ready_file": str(ready),
            "cpu_cache_size": 4 << 20,
            "max_block_size": 1 << 20,
            "staged_ttl_s": 0.3,
            "eviction_report_interval_s": 0.05,
            "log_format": "json",
        }
        try:
            async with node_process(config, tmp_path / "node.log") as proc:
                await until(ready.exists)
                doc = json.loads(ready.read_text())
                assert doc["role"] == "node"
                assert doc["member_id"] == 1
                assert doc["pid"] == proc.pid
                assert doc["node_id"] == "n1"
                reg = fake.registrations[0]
                assert reg.data_address == doc["data"]
                assert reg.admin_address == doc["admin"]
                assert reg.capacity_bytes == 4 << 20
                assert reg.incarnation != 0
                assert len(reg.request_id) == 16

                admin = create_channel(doc["admin"])
                stats = await unary(
                    node_pb2_grpc.NodeAdminStub(admin).GetStats,
                    node_pb2.GetStatsRequest(),
                    timeout_s=5,
                )
                assert stats.member_id == 1
                assert stats.tiers[0].capacity_bytes == 4 << 20
                await admin.close()
                await until(lambda: len(fake.heartbeats) >= 2)

                host, port = parse_tcp_address(doc["data"])
                conn = await TcpConnection.open(host, port, timeout_s=5)
                try:
                    # Staged reaper: "late" is committed on us in the index, "orphan" is not.
                    for key in ("late", "orphan"):
                        data = key.encode() * 100
                        r = await conn.request(
                            Op.PUT,
                            key.encode(),
                            write_id=7,
                            checksum=block_checksum(data),
                            payload=data,
                            timeout_s=5,
                        )
                        assert r.status == Status.OK
                    fake.index["late"] = common_pb2.BlockEntry(
                        key="late", found=True, version=42, write_id=7, replicas=[1]
                    )
                    await until(lambda: any("late" in keys for keys in fake.lookups))
                    await asyncio.sleep(0.3)
                    sink = bytearray(400)
                    got = await conn.request(
                        Op.GET, b"late", write_id=7, sink=memoryview(sink), timeout_s=5
                    )
                    assert got.status == Status.OK
                    assert got.header.version == 42
                    assert bytes(sink) == b"late" * 100
                    orphan = await conn.request(Op.GET, b"orphan", write_id=7, timeout_s=5)
                    assert orphan.status == Status.MISS

                    # Evictions: fill well past the high watermark with committed blocks.
                    block = b"e" * (256 << 10)
                    for i in range(20):
                        evict_key = f"e{i}".encode()
                        r = await conn.request(
                            Op.PUT,
                            evict_key,
                            write_id=1,
                            checksum=block_checksum(block),
                            payload=block,
                            timeout_s=5,
                        )
                        assert r.status == Status.OK
                        # The node publishes only what the index committed (with its version).
                        fake.index[evict_key.decode()] = common_pb2.BlockEntry(
                            key=evict_key.decode(), found=True, version=1, write_id=1, replicas=[1]
                        )
                        r = await conn.request(
                            Op.PUBLISH, evict_key, write_id=1, version=1, timeout_s=5
                        )
                        assert r.status == Status.OK
                    await until(lambda: sum(len(r.blocks) for r in fake.reports) >= 8)
                    reported = [(b.key, b.write_id) for r in fake.reports for b in r.blocks]
                    assert reported[0] == ("late", 7)  # least recently used goes first
                    assert all(r.member_id == 1 for r in fake.reports)
                    assert len(set(reported)) == len(reported)

                    # The index declares us down: drop everything, register again as a new
                    # member with the same incarnation (the same process: only a restart
                    # changes it, which is how the index tells a drained node's restart).
                    fake.known = False
                    await until(lambda: len(fake.registrations) == 2)
                    assert fake.registrations[1].incarnation == reg.incarnation
                    await until(lambda: json.loads(ready.read_text())["member_id"] == 2)
                    gone = await conn.request(Op.GET, b"e19", write_id=1, timeout_s=5)
                    assert gone.status == Status.MISS
                finally:
                    conn.close()

                proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(proc.wait, 10) == 0
                assert [leave.member_id for leave in fake.leaves] == [2]
            log = (tmp_path / "node.log").read_text()
            events = [
                json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")
            ]
            for event in (
                "node_started",
                "node_registered",
                "blocks_evicted",
                "node_reregistered",
                "node_stopped",
            ):
                assert event in events, (event, log)
        finally:
            await master.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_bad_config_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool.store_node.server",
            "--config-json",
            json.dumps({"data_listen": "0.0.0.0:0", "eviction_policy": "fifo"}),
        ],
        capture_output=True,
        check=False,
        timeout=30,
        # a cluster token: without one a wildcard address is refused before anything else
        env={**os.environ, "KVPOOL_CLUSTER_TOKEN": "a-test-cluster-token-0123456789"},
    )
    assert out.returncode == 2
    assert b"advertise_host" in out.stderr
    assert b"eviction_policy" in out.stderr


def test_port_in_use_exits_2(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpool.store_node.server",
                "--config-json",
                json.dumps({"data_listen": f"127.0.0.1:{port}"}),
            ],
            capture_output=True,
            check=False,
            timeout=30,
        )
    assert out.returncode == 2
    assert b"data_listen" in out.stderr


def test_sigterm_while_masters_are_unreachable_stops_promptly(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens once closed
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpool.store_node.server",
                "--config-json",
                json.dumps(
                    {
                        "masters": [f"127.0.0.1:{dead}"],
                        "cpu_cache_size": 8 << 20,
                        "max_block_size": 1 << 20,
                        "log_format": "json",
                    }
                ),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while b"node_started" not in log_path.read_bytes():
            assert time.monotonic() < deadline, log_path.read_text()
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        time.sleep(1.5)  # registering, retrying
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 4.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "node_stopped" in text
    assert "tier_prefaulted" in text
