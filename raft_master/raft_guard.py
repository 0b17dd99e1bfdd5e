"""The guard on the Raft port: PySyncObj's TCP transport, with its connections replaced by ours.

What PySyncObj 0.3.17 does with the bytes of a peer (``pysyncobj/tcp_connection.py``), measured
by an attacker's probe:

- a message is a 4-byte length and that many bytes; the length is trusted: the connection keeps
  appending what arrives to one ``bytes`` buffer (``readBuffer += incoming``, a copy of the
  whole buffer per ``recv``) until the declared length has arrived, *then* decrypts it. With
  ``password`` set the message must decrypt (Fernet: AES + HMAC) before it is unpickled, so
  nobody without the secret reaches pickle — but everybody can make a master buffer and copy
  a message of up to 2 GiB before the check. One unauthenticated connection streaming 48 MiB
  behind a 2 GiB length stalled the leader's Raft thread until it lost leadership (7 of 7
  runs);
- a half-sent message is never timed out: the idle check runs only when the socket has an
  event, and the last-read time moves on every byte;
- an accepted connection that never authenticates stays for ever.

The guard keeps PySyncObj's Raft and its wire format up to each connection's handshake, and
replaces its connection handling:

1. **Authenticate before buffering.** A connection is *unauthenticated* until the handshake has
   proved the peer knows ``raft_secret``: on a connection we accepted, the peer's random key
   and then its node address, both encrypted, the second carrying the key we sent (a replayed
   first message cannot produce it); on one we dialled, the answer carrying our key. Until
   then a message may be at most :data:`PRE_AUTH_MAX_BYTES` (the handshake's are ~150 bytes):
   a longer declared length closes the connection at once, before anything is buffered.
2. **Size limit.** After the handshake a message may be at most ``max_message_bytes``
   (``raft_max_message_bytes``, 64 MiB: PySyncObj sends entries and snapshots in 1 MiB pieces
   here). A negative or larger length closes the connection before anything is buffered. The
   buffer of an accepted length is allocated once and received into (``recv_into``): no copy
   per read. A message inflating past the limit (a deflate bomb) is refused as it inflates.
3. **Deadlines.** The handshake must be done within ``message_timeout_s`` of the connect, and
   every message must arrive whole within ``message_timeout_s`` of its first byte
   (``raft_message_timeout_s``, 5 s); a connection that misses either is closed. Checked on
   every Raft tick for every connection, whether or not its socket has events.
4. **Few strangers.** At most :data:`MAX_UNAUTHENTICATED` connections may be unauthenticated
   at once; a new one beyond that closes the oldest (a real peer's handshake takes
   milliseconds, so a flood cannot keep one out).

5. **Session messages** (``raft_session_cipher``, on by default). Past the handshake, messages
   go AES-256-GCM under keys of that connection instead of Fernet under the secret's (see "the
   session cipher" below): a tenth of the cost. A peer running plain PySyncObj can still dial
   us (we answer in kind); one we dial reads only Fernet, as do masters of releases before
   this one: a group rolling onto it runs with the setting off until every master has it.

Every refusal is logged once per peer address and minute (``raft_peer_refused``, with the
reason). :class:`GuardStats` counts them (tests, the measurement script).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import socket
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pysyncobj.pickle as pysyncobj_pickle
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.monotonic import monotonic as pysyncobj_clock
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, _getAddrType, set_keepalive
from pysyncobj.transport import TCPTransport

from kvpool.logs import OncePer, get_logger
from kvpool.transports.auth import peer_of

PRE_AUTH_MAX_BYTES = 64 << 10
"""Longest message accepted before the handshake is done."""
MAX_UNAUTHENTICATED = 64
"""Most connections in their handshake at once."""
LENGTH = struct.Struct("i")  # PySyncObj's length prefix: a native signed int
MAX_HELD = 1024
"""Messages a dialled connection holds until the acceptor's key has come back (see
:meth:`GuardedConnection.send`); one more, and the connection is dropped and redialled."""
READS_PER_EVENT = 64
"""Most ``recv_into`` calls per readable event, so one busy peer cannot starve the tick."""


@dataclass(frozen=True)
class GuardLimits:
    max_message_bytes: int = 64 << 20
    """Longest message after the handshake, as sent and once inflated."""
    message_timeout_s: float = 5.0
    pre_auth_max_bytes: int = PRE_AUTH_MAX_BYTES
    max_unauthenticated: int = MAX_UNAUTHENTICATED
    compress_level: int = 0
    """zlib level of what we send (``raft_compress_level``); any level decodes the same."""
    session_secret: bytes = b""
    """The key each connection's session keys are derived from (:func:`session_secret`; empty:
    no sessions, every message Fernet). Session messages are always read when it is set."""
    send_sessions: bool = False
    """Send session messages once a connection's handshake allows (``raft_session_cipher``);
    False: only Fernet, which masters of releases before sessions read."""


STORED_WBITS = 9
STORED_MEM_LEVEL = 1
"""zlib's smallest window (2**9 bytes) and hash table: what level 0 (stored blocks) needs."""


SESSION_MARK = b"\x01"
"""A session message's first byte: a Fernet token is base64 text (its first byte ``g``)."""
_SESSION_SALT = b"kvpool raft session v1"
_SESSION_INFO = b"kvpool raft session key v1"


def session_secret(raft_secret: str | bytes) -> bytes:
    """The 32 bytes every connection's session keys are derived from: PBKDF2 of ``raft_secret``
    (100,000 rounds, as PySyncObj derives its Fernet key; once per process, ~20 ms), with a salt
    of its own so the two keys are unrelated."""
    secret = raft_secret.encode() if isinstance(raft_secret, str) else raft_secret
    return hashlib.pbkdf2_hmac("sha256", secret, _SESSION_SALT, 100_000, 32)


def session_key(secret: bytes, sender_key: bytes, receiver_key: bytes) -> AESGCM:
    """The AES-256-GCM key of one direction of one connection: HKDF-Expand (one block, RFC
    5869) of ``secret`` over both random keys of its handshake, the one the sender wraps its
    messages in first. Each connection's two directions have keys of their own, used for no
    other connection, so a message counter is a nonce that never repeats under its key."""
    info = _SESSION_INFO + sender_key + receiver_key + b"\x01"
    return AESGCM(hmac.digest(secret, info, "sha256"))


def _nonce(seq: int) -> bytes:
    return b"\x00\x00\x00\x00" + seq.to_bytes(8, "big")


def deflate(raw: bytes, compress_level: int) -> bytes:
    """A zlib stream of ``raw`` (see :func:`encode_message` for level 0)."""
    if compress_level == 0:
        deflater = zlib.compressobj(0, zlib.DEFLATED, STORED_WBITS, STORED_MEM_LEVEL)
        return deflater.compress(raw) + deflater.flush()
    return zlib.compress(raw, compress_level)


def encode_message(message: Any, encryptor: Any, compress_level: int) -> bytes:
    """PySyncObj's encoding of one message: pickle, deflate, encrypt (Fernet) when a secret is
    set. The receiver inflates whatever level was used, so a plain PySyncObj peer reads it.

    PySyncObj deflates at level 3. We default to 0 (stored blocks, no search): the leader
    encodes every append once per follower on its Raft thread, and deflating index entries
    (hashed keys, ids, checksums) costs far more than it saves on a data-centre link. Measured
    (pickled appends of real CommitPuts entries): one put, 340 bytes: 13.5 µs at level 3,
    2.4 µs at 0; a group commit of 100 puts, 12 KB: 199 µs → 9 µs (deflate saves 40 % of
    the bytes); 100 one-put entries, 18 KB: 382 µs → 11 µs.

    At level 0 the stream is made with the smallest window and hash table zlib allows: stored
    blocks use neither, and ``zlib.compress`` allocates and clears both (~300 KiB) for every
    message — 12 µs of a 500-byte append's encoding on an idle machine, 2 µs this way. The
    result is the same kind of zlib stream; any inflater reads it."""
    data = deflate(pysyncobj_pickle.dumps(message), compress_level)
    if encryptor:
        data = encryptor.encrypt_at_time(data, int(pysyncobj_clock()))
    return data


class GuardStats:
    """What the guard refused (read from any thread)."""

    def __init__(self) -> None:
        self.oversized = 0
        self.timed_out = 0
        self.undecodable = 0
        self.evicted = 0

    @property
    def refused(self) -> int:
        return self.oversized + self.timed_out + self.undecodable + self.evicted


class GuardedConnection:
    """A drop-in for ``pysyncobj.tcp_connection.TcpConnection`` (same interface, same wire
    format) that checks every declared length before buffering it and can be timed out."""

    def __init__(
        self,
        poller: Any,
        *,
        limits: GuardLimits,
        refuse: Callable[[GuardedConnection, str], None],
        sock: socket.socket | None = None,
        timeout: float = 10.0,
        send_buffer_size: int = 2**13,
        recv_buffer_size: int = 2**13,
        keepalive: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sendRandKey: bytes | None = None
        self.recvRandKey: bytes | None = None
        self.recvLastTimestamp = 0
        self.encryptor: Any = None
        self.authenticated = False
        self.peer = "?"
        self._dialled = False  # this end connected (PySyncObj's outgoing connection)
        self._key_sent = False  # a dialler's first message, its random key, has gone
        self._held: list[Any] = []  # PySyncObj's messages given before the handshake is done
        self._reset_session()
        self._limits = limits
        self._refuse = refuse
        self._clock = clock
        self._poller = poller
        self._timeout = timeout
        self._keepalive = keepalive
        self._send_buffer_size = send_buffer_size
        self._recv_buffer_size = recv_buffer_size
        self._on_message: Callable[[Any], None] | None = None
        self._on_connected: Callable[[], None] | None = None
        self._on_disconnected: Callable[[], None] | None = None
        self._sock: socket.socket | None = None
        self._fileno: int | None = None
        self._state = CONNECTION_STATE.DISCONNECTED
        self._reset_buffers()
        self.connected_at = clock()
        if sock is not None:
            self._sock = sock
            self._fileno = sock.fileno()
            self._state = CONNECTION_STATE.CONNECTED
            self.peer = peer_of(sock)
            self._set_keepalive()
            poller.subscribe(
                self._fileno,
                self._process,
                POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR,
            )

    def _reset_buffers(self) -> None:
        self._write = bytearray()
        self._head = bytearray(LENGTH.size)
        self._head_filled = 0
        self._body: bytearray | None = None
        self._body_view: memoryview | None = None
        self._body_filled = 0
        self.message_started: float | None = None
        self._last_read = self._clock()

    # --- the TcpConnection interface PySyncObj's transport uses ------------------------------

    def setOnConnectedCallback(self, callback: Callable[[], None]) -> None:  # noqa: N802
        self._on_connected = callback

    def setOnMessageReceivedCallback(self, callback: Callable[[Any], None]) -> None:  # noqa: N802
        self._on_message = callback

    def setOnDisconnectedCallback(self, callback: Callable[[], None]) -> None:  # noqa: N802
        self._on_disconnected = callback

    @property
    def state(self) -> int:
        return int(self._state)

    def fileno(self) -> int | None:
        return self._fileno

    def getSendBufferSize(self) -> int:  # noqa: N802
        return len(self._write)

    def connect(self, host: str | None, port: int) -> bool:
        if host is None:
            return False
        self._state = CONNECTION_STATE.DISCONNECTED
        self._fileno = None
        self.authenticated = False
        self._reset_session()
        self._dialled = True
        sock = socket.socket(_getAddrType(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_size)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._set_keepalive()
        sock.setblocking(False)
        self._reset_buffers()
        self.connected_at = self._clock()
        self.peer = f"{host}:{port}"
        try:
            sock.connect((host, port))
        except OSError as e:
            if e.errno not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                sock.close()
                self._sock = None
                return False
        self._fileno = sock.fileno()
        self._state = CONNECTION_STATE.CONNECTING
        self._poller.subscribe(
            self._fileno,
            self._process,
            POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR,
        )
        return True

    def send(self, message: Any) -> None:
        """Send ``message``. A dialled connection holds what PySyncObj gives it between its
        random key and the acceptor's answer: PySyncObj sends Raft messages on a connection as
        soon as TCP connects, and one sent then, not yet wrapped in the acceptor's key, is
        refused by the acceptor, which drops the connection (a ``raft_peer_refused`` at nearly
        every start of a group). Held ones go, in order, after the dialler's address — the
        first message the acceptor reads once it has answered."""
        if self._dialled and self.encryptor is not None and not self.sendRandKey:
            if self._key_sent:
                if len(self._held) >= MAX_HELD:
                    self.disconnect()  # no answer while PySyncObj went on: dialled again
                    return
                self._held.append(message)
                return
            self._key_sent = True
        self._send(message)
        if self._held and self.sendRandKey:
            held, self._held = self._held, []
            for waiting in held:
                self._send(waiting)

    def _send(self, message: Any) -> None:
        if self.sendRandKey:
            message = (self.sendRandKey, message)
        if self._limits.send_sessions and self._session_ready():
            data = self._seal(deflate(pysyncobj_pickle.dumps(message), self._limits.compress_level))
        else:
            data = encode_message(message, self.encryptor, self._limits.compress_level)
        self._write += LENGTH.pack(len(data))
        self._write += data
        self._try_send()

    def disconnect(self) -> None:
        call = self._on_disconnected is not None and self._state != CONNECTION_STATE.DISCONNECTED
        self.sendRandKey = None
        self.recvRandKey = None
        self.recvLastTimestamp = 0
        self.authenticated = False
        self._reset_session()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
            self._fileno = None
        self._reset_buffers()
        self._state = CONNECTION_STATE.DISCONNECTED
        if call and self._on_disconnected is not None:
            self._on_disconnected()

    # --- the session cipher --------------------------------------------------------------------
    #
    # PySyncObj encrypts every message with Fernet (AES-CBC, HMAC-SHA256, base64) under the one
    # key of ``raft_secret``: ~300 µs of a 4 KiB put's commit on the Raft path (performance.md).
    # Once a connection's handshake has given both ends both random keys (the dialler's and the
    # acceptor's) and this end has read a message wrapped in the key it chose — proof that the
    # peer knows the secret and this connection's keys — its messages go as session messages:
    # SESSION_MARK, then AES-256-GCM under the direction's key (:func:`session_key`) with the
    # count of messages sent before it as the nonce, SESSION_MARK authenticated with it. The
    # receiver counts too: a message replayed, dropped, reordered or from another connection
    # does not decrypt, and closes the connection. After a session message, a Fernet one is
    # refused (no falling back within a connection).

    def _reset_session(self) -> None:
        self._key_sent = False
        self._held = []
        self._peer_wrapped = False  # read a message wrapped in the key we chose
        self._tx: AESGCM | None = None
        self._tx_seq = 0
        self._rx: AESGCM | None = None
        self._rx_seq = 0

    def _session_ready(self) -> bool:
        """Whether to send session messages: the dialler once it has read the acceptor's wrapped
        answer; the acceptor once the dialler has sent one (so a peer that dials us with plain
        PySyncObj, or with sessions off, is answered in Fernet)."""
        return bool(
            self._peer_wrapped
            and self.sendRandKey
            and self.recvRandKey
            and self._limits.session_secret
            and (self._dialled or self._rx is not None)
        )

    def _seal(self, plain: bytes) -> bytes:
        if self._tx is None:
            assert self.sendRandKey is not None
            assert self.recvRandKey is not None
            self._tx = session_key(self._limits.session_secret, self.sendRandKey, self.recvRandKey)
        sealed = self._tx.encrypt(_nonce(self._tx_seq), plain, SESSION_MARK)
        self._tx_seq += 1
        return SESSION_MARK + sealed

    def _open(self, data: bytes) -> bytes:
        """A session message's plaintext (raises when it is not the next one of this
        connection's peer)."""
        if self._rx is None:
            if not (self.sendRandKey and self.recvRandKey and self._limits.session_secret):
                raise ValueError("a session message before the handshake")
            self._rx = session_key(self._limits.session_secret, self.recvRandKey, self.sendRandKey)
        plain = self._rx.decrypt(_nonce(self._rx_seq), data[1:], SESSION_MARK)
        self._rx_seq += 1
        return plain

    # --- the guard's checks -------------------------------------------------------------------

    def expired(self, now: float) -> str:
        """Why this connection must be closed now ("" when it need not be)."""
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return ""
        limit = self._limits.message_timeout_s
        if not self.authenticated and now - self.connected_at > limit:
            return f"no handshake within {limit:g}s"
        if self.message_started is not None and now - self.message_started > limit:
            return f"a message not complete within {limit:g}s"
        return ""

    # --- internals ---------------------------------------------------------------------------

    def _set_keepalive(self) -> None:
        if self._sock is not None and self._keepalive is not None:
            set_keepalive(self._sock, *self._keepalive)

    def _process(self, descr: int, event: int) -> None:
        if descr != self._fileno:
            self._poller.unsubscribe(descr)
            return
        if event & POLL_EVENT_TYPE.ERROR:
            self.disconnect()
            return
        if self._clock() - self._last_read > self._timeout:
            self.disconnect()
            return
        sock = self._sock
        if sock is None:
            return
        if event & (POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE):
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.disconnect()
                return
            if self._state == CONNECTION_STATE.CONNECTING:
                if self._on_connected is not None:
                    self._on_connected()
                if self._state == CONNECTION_STATE.DISCONNECTED:
                    return
                self._state = CONNECTION_STATE.CONNECTED
                self._last_read = self._clock()
                return
        if event & POLL_EVENT_TYPE.WRITE:
            self._try_send()
            if self._state == CONNECTION_STATE.DISCONNECTED or self._fileno is None:
                return
            mask = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
            if self._write:
                mask |= POLL_EVENT_TYPE.WRITE
            self._poller.subscribe(descr, self._process, mask)
        if event & POLL_EVENT_TYPE.READ:
            self._read()

    def _try_send(self) -> None:
        if self._clock() - self._last_read > self._timeout:
            self.disconnect()
            return
        while self._write and self._sock is not None:
            try:
                sent = self._sock.send(self._write)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self.disconnect()
                return
            if sent <= 0:
                return
            del self._write[:sent]

    def _read(self) -> None:
        for _ in range(READS_PER_EVENT):
            sock = self._sock
            if sock is None or self._state == CONNECTION_STATE.DISCONNECTED:
                return
            if self._body_view is None:
                target = memoryview(self._head)[self._head_filled :]
            else:
                target = self._body_view[self._body_filled :]
            try:
                n = sock.recv_into(target)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self.disconnect()
                return
            if n == 0:
                self.disconnect()
                return
            self._last_read = self._clock()
            if self.message_started is None:
                self.message_started = self._last_read
            if self._body_view is None:
                self._head_filled += n
                if self._head_filled < LENGTH.size:
                    continue
                (length,) = LENGTH.unpack(self._head)
                limit = (
                    self._limits.max_message_bytes
                    if self.authenticated
                    else self._limits.pre_auth_max_bytes
                )
                if length < 0 or length > limit:
                    state = "after" if self.authenticated else "before"
                    self._refuse(
                        self, f"a message of {length} bytes {state} the handshake (limit {limit})"
                    )
                    return
                self._body = bytearray(length)
                self._body_view = memoryview(self._body)
                self._body_filled = 0
                if length:
                    continue
            else:
                self._body_filled += n
            body = self._body
            if body is None or self._body_filled < len(body):
                continue
            self._head_filled = 0
            self._body, self._body_view, self._body_filled = None, None, 0
            self.message_started = None
            message, ok = self._decode(bytes(body))
            if not ok:
                self._refuse(self, "a message that does not decrypt or decode")
                return
            if self._on_message is not None:
                self._on_message(message)

    def _decode(self, data: bytes) -> tuple[Any, bool]:
        """PySyncObj's decoding of one message (decrypt, inflate, unpickle, check the key).
        Inflated to at most the message limit: a few KiB of deflate can declare gigabytes, and
        even a peer holding the secret must not make a master allocate them."""
        try:
            if self.encryptor and data[:1] == SESSION_MARK:
                data = self._open(data)
            elif self.encryptor:
                if self._rx is not None:
                    return None, False  # Fernet after session messages: no falling back
                stamp = self.encryptor.extract_timestamp(data)
                if stamp < self.recvLastTimestamp:
                    return None, False
                self.recvLastTimestamp = stamp
                data = self.encryptor.decrypt(data)
            limit = (
                self._limits.max_message_bytes
                if self.authenticated
                else self._limits.pre_auth_max_bytes
            )
            inflater = zlib.decompressobj()
            plain = inflater.decompress(data, limit)
            if inflater.unconsumed_tail or not inflater.eof:
                return None, False  # inflates past the limit, or not one whole zlib stream
            message = pysyncobj_pickle.loads(plain)
            if self.recvRandKey:
                rand_key, message = message
                if rand_key != self.recvRandKey:
                    return None, False
                self._peer_wrapped = True
        except Exception:  # PySyncObj drops the connection on any decoding failure too
            return None, False
        return message, True


class GuardedServer:
    """``pysyncobj.tcp_server.TcpServer`` accepting :class:`GuardedConnection` s."""

    def __init__(
        self,
        poller: Any,
        host: str,
        port: int,
        on_new_connection: Callable[[socket.socket], None],
        *,
        send_buffer_size: int,
        recv_buffer_size: int,
    ) -> None:
        self._poller = poller
        self._host = host
        self._port = int(port)
        self._family = _getAddrType(host)
        self._send_buffer_size = send_buffer_size
        self._recv_buffer_size = recv_buffer_size
        self._on_new_connection = on_new_connection
        self._sock: socket.socket | None = None
        self._fileno: int | None = None

    def bind(self) -> None:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_size)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
            sock.bind((self._host, self._port))
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._fileno = sock.fileno()
        self._poller.subscribe(
            self._fileno, self._accept, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
        )

    def unbind(self) -> None:
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
            self._fileno = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _accept(self, descr: int, event: int) -> None:
        if event & POLL_EVENT_TYPE.READ and self._sock is not None:
            for _ in range(16):
                try:
                    sock, _addr = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break  # EMFILE and friends: try again on the next event
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_size)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_size)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setblocking(False)
                except OSError:
                    sock.close()
                    continue
                self._on_new_connection(sock)
        if event & POLL_EVENT_TYPE.ERROR:
            self.unbind()


class GuardedTransport(TCPTransport):  # type: ignore[misc]
    """PySyncObj's TCP transport over :class:`GuardedConnection` and :class:`GuardedServer`;
    the handshake marks connections authenticated, and every tick closes expired ones."""

    def __init__(
        self,
        syncObj: Any,  # noqa: N803 - PySyncObj's argument names
        selfNode: Any,  # noqa: N803
        otherNodes: Any,  # noqa: N803
        *,
        limits: GuardLimits,
        stats: GuardStats | None = None,
        log: Any = None,
    ) -> None:
        self.guard_limits = limits
        self.guard_stats = stats if stats is not None else GuardStats()
        self._guard_log = OncePer(log if log is not None else get_logger("kvpool.raft_master"))
        self._guard_next_sweep = 0.0
        super().__init__(syncObj, selfNode, otherNodes)

    # --- connections and server ------------------------------------------------------------

    def _new_connection(self, sock: socket.socket | None = None) -> GuardedConnection:
        conf = self._syncObj.conf
        return GuardedConnection(
            self._syncObj._poller,
            limits=self.guard_limits,
            refuse=self._refuse,
            sock=sock,
            timeout=conf.connectionTimeout,
            send_buffer_size=conf.sendBufferSize,
            recv_buffer_size=conf.recvBufferSize,
            keepalive=conf.tcp_keepalive,
        )

    def _createServer(self) -> None:  # noqa: N802 - PySyncObj's hook
        conf = self._syncObj.conf
        bind_address = conf.bindAddress
        own = getattr(self._selfNode, "address", None)
        if bind_address is not None:
            host, port = bind_address.rsplit(":", 1)
        elif own is not None:
            host, port = own.rsplit(":", 1)
            host = "::" if ":" in host else "0.0.0.0"
        else:
            raise RuntimeError("Unable to determine bind address")
        if host != "0.0.0.0":
            host = globalDnsResolver().resolve(host)
        self._server = GuardedServer(
            self._syncObj._poller,
            host,
            int(port),
            self._accepted,
            send_buffer_size=conf.sendBufferSize,
            recv_buffer_size=conf.recvBufferSize,
        )

    def _accepted(self, sock: socket.socket) -> None:
        strangers = [c for c in self._unknownConnections if not c.authenticated]
        while len(strangers) >= self.guard_limits.max_unauthenticated:
            oldest = min(strangers, key=lambda c: c.connected_at)
            strangers.remove(oldest)
            self.guard_stats.evicted += 1
            self._log_refusal(oldest, "too many connections in their handshake: oldest closed")
            oldest.disconnect()
        self._onNewIncomingConnection(self._new_connection(sock))

    def addNode(self, node: Any) -> None:  # noqa: N802 - PySyncObj's interface
        self._nodes.add(node)
        self._nodeAddrToNode[node.address] = node
        if self._shouldConnect(node):
            conn = self._new_connection()
            conn.encryptor = self._syncObj.encryptor
            conn.setOnConnectedCallback(functools.partial(self._onOutgoingConnected, conn))
            conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))
            conn.setOnDisconnectedCallback(functools.partial(self._onDisconnected, conn))
            self._connections[node] = conn

    # --- the handshake marks a connection authenticated --------------------------------------

    def _onIncomingMessageReceived(self, conn: GuardedConnection, message: Any) -> None:  # noqa: N802
        super()._onIncomingMessageReceived(conn, message)
        if conn in self._connections.values():
            conn.authenticated = True  # its node address carried the key we sent

    def _onOutgoingConnected(self, conn: GuardedConnection) -> None:  # noqa: N802
        super()._onOutgoingConnected(conn)
        if not self._syncObj.encryptor:
            conn.authenticated = True  # no secret: nothing more to prove (never in kvpool)

    def _onOutgoingMessageReceived(self, conn: GuardedConnection, message: Any) -> None:  # noqa: N802
        super()._onOutgoingMessageReceived(conn, message)
        conn.authenticated = True  # the answer carried the key we sent

    # --- sweeping ------------------------------------------------------------------------------

    def _onTick(self) -> None:  # noqa: N802 - PySyncObj's hook
        super()._onTick()
        now = time.monotonic()
        if now < self._guard_next_sweep:
            return
        self._guard_next_sweep = now + min(0.1, self.guard_limits.message_timeout_s / 4)
        for conn in [*self._unknownConnections, *self._connections.values()]:
            if not isinstance(conn, GuardedConnection):
                continue
            why = conn.expired(now)
            if why:
                self.guard_stats.timed_out += 1
                self._log_refusal(conn, why)
                conn.disconnect()

    def _refuse(self, conn: GuardedConnection, why: str) -> None:
        if why.startswith("a message of"):
            self.guard_stats.oversized += 1
        else:
            self.guard_stats.undecodable += 1
        self._log_refusal(conn, why)
        conn.disconnect()

    def _log_refusal(self, conn: GuardedConnection, why: str) -> None:
        host = conn.peer.rsplit(":", 1)[0]
        self._guard_log.warning(
            "raft_peer_refused",
            host,
            peer=conn.peer,
            reason=why,
            authenticated=conn.authenticated,
        )


def guarded_transport(
    limits: GuardLimits, stats: GuardStats | None = None, log: Any = None
) -> Callable[..., GuardedTransport]:
    """The ``transportClass`` to give ``SyncObj``."""
    return functools.partial(GuardedTransport, limits=limits, stats=stats, log=log)
