"""The machine's own limits, measured the way a Python program meets them: what no store on
this host can beat, so that ``kvpool-bench peers`` can say how close each one gets.

* :func:`memcpy_gbps` — numpy copying one large buffer into another (memory bandwidth as a
  single Python thread sees it).
* :class:`TcpSink` / :func:`tcp_send_gbps` — one loopback TCP stream between two Python
  processes: ``sendall`` of a preallocated buffer on one side, ``recv_into`` a preallocated
  buffer on the other (no copies in Python, no framing).

GB here is 10⁹ bytes, as in every kvpool benchmark.
"""

from __future__ import annotations

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
