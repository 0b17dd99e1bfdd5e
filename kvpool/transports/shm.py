"""The ``shm://name`` transport: a same-host client reads and writes a node's CPU arena directly.

The node's CPU tier is one memfd arena. A node offering shared memory listens on an abstract
unix socket (``shm://<name>``, named in its HELLO answer); on connect it sends a preamble and the
arena's file descriptor (``SCM_RIGHTS``), which the client maps. From then on the connection
speaks ordinary frames plus four ops (:mod:`kvpool.proto.wire`):

* ``SHM_GET`` — for each (key, write id): where the block lies in the arena, *leased*: the node
  will not evict or reuse those bytes until the client sends ``SHM_RELEASE`` (or the connection
  closes, or the lease outlives ``lease_timeout_s`` and the node cuts the connection). The
  client copies the bytes out and checks the checksum on its own copy, as over TCP.
* ``SHM_RESERVE`` / ``SHM_COMMIT`` — a put: the node reserves an extent (invisible, as a TCP PUT
  whose payload is arriving), the client copies the value in, and the commit has the node verify
  the checksum and stage the block. Publish, delete and everything else are the usual frames.

So a get copies each block once (arena → caller's buffer) and a put once (caller → arena), with
no socket in between. Abstract unix sockets belong to a network namespace, so only a client in
the node's namespace (same host, no partition between them) can connect. A client that dies
mid-copy leaves a reservation that is aborted when its connection drops; a copy that outlives its
lease can only produce a checksum mismatch (a miss), never a wrong read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import mmap
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.errors import DeadlineExceededError, TransportError
from kvpool.proto.wire import HEADER_SIZE
from kvpool.transports.auth import auth_frame, read_answer, read_answer_blocking
from kvpool.transports.blocking import BlockingConnection, connecting, time_left
from kvpool.transports.directory import DirectoryReader
from kvpool.transports.tcp import FrameConnection

PREAMBLE = struct.Struct("<4sQ16s")
"""What the node sends first, with the arena's fd: magic, arena size, arena token."""
SHM_MAGIC = b"KVPS"
MADV_POPULATE_WRITE = 23
PREFAULT_CHUNK_BYTES = 16 << 20
PREFAULT_MAX_BYTES = 64 << 30
"""Arena bytes whose page tables a client fills ahead of use (page tables cost 2 MiB per GiB
mapped: the rest faults in as it is touched)."""


def shm_supported() -> bool:
    """Linux (abstract unix sockets, memfd, SCM_RIGHTS)."""
    return sys.platform.startswith("linux") and hasattr(socket, "recv_fds")


def parse_shm_address(address: str) -> str:
    if not address.startswith("shm://") or len(address) <= len("shm://"):
        raise TransportError(f"not a shm://name address: {address!r}")
    return address[len("shm://") :]


class Arena:
    """A node's CPU arena mapped into this process, shared by every connection to it.

    The first touch of each 4 KiB page by this process is a page fault (the node has the memory
    committed, but this process's page tables are empty): measured at ~300 µs per MiB here,
    against ~40 µs for a copy into mapped pages. So a thread fills the page tables in the
    background as soon as the arena is mapped (``MADV_POPULATE_WRITE``, chunk by chunk, without
    the GIL), up to :data:`PREFAULT_MAX_BYTES`; copies meanwhile just fault as usual."""

    def __init__(
        self, fd: int, size: int, token: bytes, directory: DirectoryReader | None = None
    ) -> None:
        self.size = size
        self.token = token
        self.directory = directory
        """The node's directory of the blocks in this arena (:mod:`kvpool.transports.directory`),
        when it offers one and ``KVPOOL_SHM_DIRECTORY`` is not ``0``."""
        self._mmap = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.view: memoryview = memoryview(self._mmap)
        self.users = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.prefaulted_bytes = 0
        self._prefault = threading.Thread(
            target=self._fill_page_tables, name="kvpool-shm-prefault", daemon=True
        )
        self._prefault.start()

    def _fill_page_tables(self) -> None:
        madvise = libc_madvise()
        if madvise is None:
            return
        with self._lock:
            if self._closing.is_set():
                return
            holder = (ctypes.c_char * self.size).from_buffer(self._mmap)
            base = ctypes.addressof(holder)
            del holder  # no export may outlive this block: close() must stay possible
        done, limit = 0, min(self.size, PREFAULT_MAX_BYTES)
        while done < limit and not self._closing.is_set():
            length = min(PREFAULT_CHUNK_BYTES, limit - done)
            with self._lock:
                if self._closing.is_set() or madvise(base + done, length, MADV_POPULATE_WRITE):
                    return  # closed, or a kernel without MADV_POPULATE_WRITE (before 5.14)
            done += length
            self.prefaulted_bytes = done

    def wait_prefaulted(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the page tables to be filled (a warm-up's: the filling
        competes for CPU with the first calls); whether they are."""
        self._prefault.join(max(0.0, timeout_s))
        return not self._prefault.is_alive()

    def extent(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise TransportError(f"extent [{offset}, {offset + size}) outside the arena")
        return self.view[offset : offset + size]

    def close(self) -> None:
        self._closing.set()
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        with self._lock:  # waits for a populate call in progress
            self.view.release()
            with contextlib.suppress(BufferError):
                self._mmap.close()


_ARENAS: dict[bytes, Arena] = {}
_ARENAS_LOCK = threading.Lock()


def _adopt_arena(fd: int, size: int, token: bytes, directory_fds: list[int]) -> Arena:
    with _ARENAS_LOCK:
        arena = _ARENAS.get(token)
        if arena is None or arena.size != size:
            arena = Arena(fd, size, token, _directory(directory_fds))
            _ARENAS[token] = arena
        arena.users += 1
        return arena


def _drop_arena(arena: Arena) -> None:
    with _ARENAS_LOCK:
        arena.users -= 1
        if arena.users <= 0 and _ARENAS.get(arena.token) is arena:
            del _ARENAS[arena.token]
            arena.close()


def _directory(fds: list[int]) -> DirectoryReader | None:
    """The node's directory from its two fds; None when it sent none, when it is not one this
    client can read (then it reads through the node), or when ``KVPOOL_SHM_DIRECTORY=0``."""
    if len(fds) != 2 or os.environ.get("KVPOOL_SHM_DIRECTORY", "1").strip().lower() in (
        "0",
        "off",
        "false",
        "no",
    ):
        return None
    try:
        return DirectoryReader(fds[0], fds[1])
    except (OSError, ValueError):
        return None


def _take_preamble(sock: socket.socket, address: str, size: int = PREAMBLE.size) -> Arena:
    """Receive the preamble and the arena's fd (the socket is ready to read)."""
    msg, fds = _recv_offer(sock, address, size)
    return _arena_from(msg, fds, address)


def _recv_offer(sock: socket.socket, address: str, size: int) -> tuple[bytes, list[int]]:
    try:
        msg, fds, _flags, _addr = socket.recv_fds(sock, size, 3)
    except (BlockingIOError, TimeoutError):
        raise DeadlineExceededError(f"{address}: no arena offered in time") from None
    except OSError as e:
        raise TransportError(f"{address}: receiving the arena failed: {e}") from None
    return msg, fds


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            socket.close(fd)


def _take_offer_blocking(
    sock: socket.socket, token: bytes, address: str, timeout_s: float
) -> Arena:
    """The arena of a node, proving ``token`` first when there is one. A node with a token
    answers AUTH, then sends the arena; a node without one sends the arena at once and answers
    AUTH after it. Either way the arena is never handed to a peer that failed the check."""
    if not token:
        return _take_preamble(sock, address)
    deadline = time.monotonic() + max(0.001, timeout_s)
    try:
        sock.sendall(auth_frame(token))
    except OSError as e:
        raise TransportError(f"{address}: sending the cluster token failed: {e}") from None
    msg, fds = _recv_offer(sock, address, HEADER_SIZE)
    if msg[:4] == SHM_MAGIC:
        arena = _arena_from(msg, fds, address)
        try:
            read_answer_blocking(sock, deadline, address)
        except BaseException:
            _drop_arena(arena)
            raise
        return arena
    _close_fds(fds)
    read_answer_blocking(sock, deadline, address, head=msg)
    return _take_preamble(sock, address)


async def _take_offer(sock: socket.socket, token: bytes, address: str) -> Arena:
    """:func:`_take_offer_blocking` on the event loop (``sock`` non-blocking)."""
    loop = asyncio.get_running_loop()
    if token:
        await loop.sock_sendall(sock, auth_frame(token))
    await _readable(loop, sock)
    if not token:
        return _take_preamble(sock, address)
    msg, fds = _recv_offer(sock, address, HEADER_SIZE)
    if msg[:4] == SHM_MAGIC:
        arena = _arena_from(msg, fds, address)
        try:
            await read_answer(sock, address)
        except BaseException:
            _drop_arena(arena)
            raise
        return arena
    _close_fds(fds)
    await read_answer(sock, address, head=msg)
    await _readable(loop, sock)
    return _take_preamble(sock, address)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), _set_once, ready)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _arena_from(msg: bytes, fds: list[int], address: str) -> Arena:
    try:
        if len(msg) != PREAMBLE.size or not fds:
            raise TransportError(f"{address}: not a kvpool shared-memory peer")
        magic, size, token = PREAMBLE.unpack(msg)
        if magic != SHM_MAGIC or size <= 0:
            raise TransportError(f"{address}: not a kvpool shared-memory peer")
        try:
            return _adopt_arena(fds[0], size, token, fds[1:])
        except (OSError, ValueError) as e:
            raise TransportError(f"{address}: cannot map the arena: {e}") from None
    finally:
        _close_fds(fds)


def _unix_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


class ShmBlockingConnection(BlockingConnection):
    """A blocking connection to a node's shared-memory socket, with its arena mapped."""

    def __init__(self, sock: socket.socket, address: str, arena: Arena, timeout_s: float) -> None:
        super().__init__(sock, address, timeout_s=timeout_s)
        self.arena: Arena | None = arena

    def close(self) -> None:
        super().close()
        arena, self.arena = self.arena, None
        if arena is not None:
            _drop_arena(arena)


class ShmConnection(FrameConnection):
    """An event-loop connection to a node's shared-memory socket, with its arena mapped."""

    def __init__(self, address: str, arena: Arena) -> None:
        super().__init__(address)
        self.arena: Arena | None = arena

    def stream_closed(self, error: Exception | None) -> None:
        super().stream_closed(error)
        arena, self.arena = self.arena, None
        if arena is not None:
            _drop_arena(arena)


class ShmTransport:
    scheme = "shm"

    async def open(self, address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
        name = parse_shm_address(address)
        loop = asyncio.get_running_loop()
        sock = _unix_socket()
        sock.setblocking(False)
        with connecting(address, sock):
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, "\0" + name)
                arena = await _take_offer(sock, token, address)
        conn = ShmConnection(address, arena)
        conn.attach(sock)
        return conn

    def open_blocking(
        self, address: str, timeout_s: float, token: bytes = b""
    ) -> BlockingConnection:
        name = parse_shm_address(address)
        sock = _unix_socket()
        deadline = time.monotonic() + timeout_s
        with connecting(address, sock):
            sock.settimeout(max(0.001, timeout_s))
            sock.connect("\0" + name)
            sock.settimeout(time_left(deadline))
            arena = _take_offer_blocking(sock, token, address, time_left(deadline))
        return ShmBlockingConnection(sock, address, arena, time_left(deadline))


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes (which drops the GIL during the call), or None; looked up
    once per process, in the symbols already loaded (``dlopen(NULL)``): never through
    ``ctypes.util.find_library``, which forks ``ldconfig`` — a fork of a whole engine process."""
    fn: Any = None
    for name in (None, "libc.so.6"):
        try:
            fn = ctypes.CDLL(name, use_errno=True).madvise
            break
        except (OSError, AttributeError):
            continue
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = fn
    return madvise


def _set_once(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)
