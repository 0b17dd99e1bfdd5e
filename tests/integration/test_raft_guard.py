"""The Raft port against strangers (issue 16, finding 3): three real masters on loopback; an
unauthenticated peer streams a huge message, sends garbage, or stays silent. The leader must
keep its leadership (no new term), its memory must not grow by the declared size, and the
connection must be closed fast."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from pathlib import Path

import pytest

from kvpool.raft_master.local_group import LocalMasterGroup

pytestmark = pytest.mark.integration


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the peer closed ``sock`` (None: still open after ``timeout_s``)."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < timeout_s:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


def stream_behind_huge_length(address: str, send_bytes: int) -> tuple[int, float | None]:
    """Declare a 2 GiB message, then push ``send_bytes`` of it; (bytes the master took, seconds
    until it closed the connection)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=2.0)
    sent = 0
    chunk = b"\x00" * 65536
    try:
        sock.sendall(struct.pack("i", 2**31 - 1))
        sock.settimeout(0.5)
        started = time.monotonic()
        while sent < send_bytes:
            try:
                sent += sock.send(chunk)
            except (TimeoutError, OSError):
                break
        closed = closed_within(sock, 3.0)
        return sent, (None if closed is None else time.monotonic() - started)
    finally:
        sock.close()


def test_a_stranger_cannot_take_leadership_or_memory(tmp_path: Path) -> None:
    with LocalMasterGroup(tmp_path, 3, settings={"raft_message_timeout_s": 1.0}) as group:
        group.start()
        leader = asyncio.run(group.wait_leader())
        deadline = time.monotonic() + 10
        while True:  # the status is a snapshot taken every 0.1 s: wait for this term's
            status = asyncio.run(group.status(leader)).master
            if (status.role == "leader" and status.term > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        term = status.term
        pid = group.masters[leader].pid
        assert pid is not None
        rss_before = rss_mib(pid)
        raft = group.masters[leader].raft

        # 1. 48 MiB behind a 2 GiB length, three times (7 of 7 runs lost leadership before).
        for _ in range(3):
            sent, closed_s = stream_behind_huge_length(raft, 48 << 20)
            assert closed_s is not None, "the oversized message was kept"
            assert closed_s < 2.0
            assert sent < 48 << 20  # cut long before all of it went
        # 2. Silent connections, and one that sends half a message: closed after the timeout.
        host, port = raft.rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=2.0) for _ in range(5)]
        half = socket.create_connection((host, int(port)), timeout=2.0)
        half.sendall(struct.pack("i", 1000) + b"x" * 10)
        for sock in [*silent, half]:
            took = closed_within(sock, 4.0)
            sock.close()
            assert took is not None, "a silent or half-sent connection was never closed"
        # 3. Garbage that does not decrypt.
        junk = socket.create_connection((host, int(port)), timeout=2.0)
        junk.sendall(struct.pack("i", 200) + b"\x01" * 200)
        assert closed_within(junk, 2.0) is not None
        junk.close()

        after = asyncio.run(group.status(leader)).master
        assert after.role == "leader", f"leadership lost:\n{group.logs()}"
        assert after.term == term, f"elections happened (term {term} -> {after.term})"
        grown = rss_mib(pid) - rss_before
        assert grown < 40, f"the leader grew by {grown:.0f} MiB"
        log = group.masters[leader].log_path.read_text()
        assert "raft_peer_refused" in log
        # One line per peer host and minute, not one per connection.
        assert log.count("raft_peer_refused") <= 3
