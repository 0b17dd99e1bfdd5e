"""The machine's own limits, measured the way a Python program meets them: what no store on
this host can beat, so that ``kvpool-bench peers`` can say how close each one gets.

* :func:`memcpy_gbps` — numpy copying one large buffer into another (memory bandwidth as a
  single Python thread sees it).
* :class:`TcpSink` / :func:`tcp_send_gbps` — one loopback TCP stream between two Python
  processes: ``sendall`` of a preallocated buffer on one side, ``recv_into`` a preallocated
  buffer on the other (no copies in Python, no framing).
* :func:`round_trip_us` — one request and its 2-byte answer at a time between two Python
  processes over loopback TCP, the way every index call travels: what a call to any server
  on this host costs before the server does anything (on a VM, mostly waking the other side).

GB here is 10⁹ bytes, as in every kvpool benchmark.
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time

import numpy as np

GB = 1e9
TCP_CHUNK_BYTES = 4 << 20
"""What one ``sendall`` / ``recv_into`` moves at most: large enough that the per-call cost of
Python disappears."""
ACK = b"k"


def memcpy_gbps(size_bytes: int = 64 << 20, repeats: int = 8) -> dict[str, float]:
    """Median GB/s of ``np.copyto`` between two ``size_bytes`` buffers (pages touched first)."""
    src = np.ones(size_bytes, dtype=np.uint8)
    dst = np.zeros(size_bytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault every page in before timing
    rates = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        np.copyto(dst, src)
        rates.append(size_bytes / (time.perf_counter() - t) / GB)
    return {"GBps": statistics.median(rates), "size_bytes": float(size_bytes)}


class TcpSink:
    """The receiving end of the loopback TCP limit: listens on 127.0.0.1 (an ephemeral port),
    accepts one connection, reads ``total_bytes`` into one reused buffer, answers one byte."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1)
        self.port = int(self._listener.getsockname()[1])

    def receive(self, total_bytes: int, timeout_s: float = 60.0) -> dict[str, float]:
        """Accept, read everything, acknowledge; the receiver's own view of the rate."""
        self._listener.settimeout(timeout_s)
        conn, _ = self._listener.accept()
        try:
            conn.settimeout(timeout_s)
            buf = bytearray(TCP_CHUNK_BYTES)
            view = memoryview(buf)
            got = 0
            first = 0.0
            while got < total_bytes:
                n = conn.recv_into(view[: min(TCP_CHUNK_BYTES, total_bytes - got)])
                if n == 0:
                    raise ConnectionError(f"sender closed after {got} of {total_bytes} bytes")
                if got == 0:
                    first = time.perf_counter()
                got += n
            last = time.perf_counter()
            conn.sendall(ACK)
            return {"received_bytes": float(got), "receive_s": last - first}
        finally:
            conn.close()

    def close(self) -> None:
        self._listener.close()


def tcp_send_gbps(port: int, total_bytes: int, timeout_s: float = 60.0) -> dict[str, float]:
    """Send ``total_bytes`` to a :class:`TcpSink` on 127.0.0.1:``port`` and wait for its
    acknowledgement: GB/s from the first byte handed to the kernel to the acknowledgement."""
    payload = memoryview(np.ones(TCP_CHUNK_BYTES, dtype=np.uint8).data.cast("B"))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        t = time.perf_counter()
        while sent < total_bytes:
            n = min(TCP_CHUNK_BYTES, total_bytes - sent)
            conn.sendall(payload[:n])
            sent += n
        if conn.recv(1) != ACK:
            raise ConnectionError("the receiver did not acknowledge the transfer")
        elapsed = time.perf_counter() - t
    return {"GBps": total_bytes / elapsed / GB, "bytes": float(total_bytes), "time_s": elapsed}


def _answer_requests(listener: socket.socket) -> None:
    """The far end of :func:`round_trip_us`: read a 4-byte length and that many bytes, answer
    two bytes, until the connection closes."""
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(1 << 20))
        while True:
            head = conn.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            size = min(int.from_bytes(head, "little"), len(buf))
            got = 0
            while got < size:
                n = conn.recv_into(buf[got:size])
                if n == 0:
                    return
                got += n
            conn.sendall(b"ok")


def round_trip_us(
    request_bytes: tuple[int, ...] = (64, 16384), calls: int = 2000
) -> dict[str, float]:
    """p50 µs of one request of each size and its 2-byte answer, one at a time, to a child
    process over loopback TCP (TCP_NODELAY, blocking sockets, no framing beyond a length)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    child = multiprocessing.get_context("fork").Process(
        target=_answer_requests, args=(listener,), daemon=True
    )
    child.start()
    out: dict[str, float] = {}
    try:
        with socket.create_connection(listener.getsockname(), timeout=30) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for size in request_bytes:
                message = size.to_bytes(4, "little") + bytes(size)
                times = []
                for _ in range(max(1, calls)):
                    t = time.perf_counter()
                    conn.sendall(message)
                    if conn.recv(2, socket.MSG_WAITALL) != b"ok":
                        raise ConnectionError("the round-trip peer did not answer")
                    times.append(time.perf_counter() - t)
                out[f"{size}B_p50_us"] = statistics.median(times) * 1e6
    finally:
        listener.close()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    return out
