"""What our Raft connections send is what a plain PySyncObj peer reads, at any zlib level; and
the session messages that follow each connection's handshake (``raft_session_cipher``)."""

from __future__ import annotations

import socket
import struct

import pytest
from cryptography.exceptions import InvalidTag
from pysyncobj.encryptor import getEncryptor
from pysyncobj.poller import createPoller
from pysyncobj.tcp_connection import TcpConnection

from kvpool.config import MasterConfig, load_config
from kvpool.errors import ConfigError
from kvpool.raft_master.raft_guard import (
    MAX_HELD,
    SESSION_MARK,
    GuardedConnection,
    GuardLimits,
    encode_message,
    session_key,
    session_secret,
)

APPEND = {
    "type": "append_entries",
    "term": 3,
    "commit_index": 1000,
    "entries": [(b"\x00" + b"llama3-8b/tp0/block-%06d" % i * 4, 1001 + i, 3) for i in range(50)],
    "prevLogIdx": 1000,
    "prevLogTerm": 3,
}


def read_as_pysyncobj(data: bytes, encryptor: object) -> object:
    """PySyncObj 0.3.17's own parsing of one received message (its TcpConnection)."""
    conn = TcpConnection(createPoller("select"))
    conn.encryptor = encryptor
    conn._TcpConnection__readBuffer = struct.pack("i", len(data)) + data
    return conn._TcpConnection__processParseMessage()


@pytest.mark.parametrize("level", [0, 1, 3, 9])
def test_every_level_is_read_by_a_plain_pysyncobj_peer(level: int) -> None:
    encryptor = getEncryptor("secret")
    assert read_as_pysyncobj(encode_message(APPEND, encryptor, level), encryptor) == APPEND


def test_level_0_stores_and_higher_levels_deflate() -> None:
    stored = encode_message(APPEND, None, 0)
    deflated = encode_message(APPEND, None, 3)
    assert len(deflated) < len(stored) * 0.7  # these entries repeat themselves
    assert read_as_pysyncobj(stored, None) == APPEND


def test_a_stored_message_far_larger_than_its_small_window_reads_back_whole() -> None:
    """Level 0 is made with zlib's smallest window (raft_guard.STORED_WBITS): stored blocks do
    not use it, so a 3 MiB append reads back byte for byte, in PySyncObj and in our guard."""
    big = dict(APPEND, entries=[(bytes(range(256)) * 4096 + b"%d" % i, i, 3) for i in range(3)])
    encryptor = getEncryptor("secret")
    data = encode_message(big, encryptor, 0)
    assert read_as_pysyncobj(data, encryptor) == big
    message, ok = guarded(GuardLimits(8 << 20), encryptor)._decode(data)
    assert ok
    assert message == big


def test_the_default_is_stored_and_a_bad_level_is_refused_naming_the_setting() -> None:
    assert GuardLimits().compress_level == 0
    assert MasterConfig().raft_compress_level == 0
    with pytest.raises(ConfigError, match="raft_compress_level: must be 0 to 9"):
        load_config(
            MasterConfig,
            env={"KVPOOL_RAFT_SECRET": "s3cret"},
            overrides={"in_memory": True, "raft_compress_level": 10},
        )


def guarded(limits: GuardLimits, encryptor: object) -> GuardedConnection:
    conn = GuardedConnection(createPoller("select"), limits=limits, refuse=lambda _c, _why: None)
    conn.encryptor = encryptor
    conn.authenticated = True
    return conn


def test_a_message_inflating_past_the_limit_is_refused_as_it_inflates() -> None:
    encryptor = getEncryptor("secret")
    limits = GuardLimits(max_message_bytes=1 << 20)
    conn = guarded(limits, encryptor)
    assert conn._decode(encode_message(APPEND, encryptor, 3)) == (APPEND, True)
    # A real message of 8 MiB of zeros deflates to ~8 KiB: well under the frame limit, far
    # over it once inflated — refused (without the bound it decoded: a bomb from a secret
    # holder could make a master allocate gigabytes).
    bomb = encode_message(b"\x00" * (8 << 20), encryptor, 9)
    assert len(bomb) < 64 << 10
    assert conn._decode(bomb) == (None, False)
    # The same message within a larger limit is read.
    roomy = guarded(GuardLimits(max_message_bytes=16 << 20), encryptor)
    assert roomy._decode(bomb) == (b"\x00" * (8 << 20), True)


def test_raft_max_message_bytes_must_hold_a_whole_append() -> None:
    with pytest.raises(ConfigError, match="raft_max_message_bytes: must be at least 4 MiB"):
        load_config(
            MasterConfig,
            env={"KVPOOL_RAFT_SECRET": "s3cret"},
            overrides={"in_memory": True, "raft_max_message_bytes": 2 << 20},
        )


# --- session messages (raft_session_cipher) ---------------------------------------------------


class Link:
    """Two guarded connections over a socket pair, taken through PySyncObj's handshake by hand
    (what its transport does): the dialler sends its random key, the acceptor answers with its
    own, the dialler sends its address; then each end sends what it likes."""

    def __init__(self, dialler: GuardLimits, acceptor: GuardLimits, secret: str = "s3cret") -> None:
        self.socks = socket.socketpair()
        self.refused: list[str] = []
        self.got: dict[str, list[object]] = {"d": [], "a": []}
        self.ends: dict[str, GuardedConnection] = {}
        for name, sock, limits in (("d", self.socks[0], dialler), ("a", self.socks[1], acceptor)):
            sock.setblocking(False)
            conn = GuardedConnection(
                createPoller("select"),
                limits=limits,
                refuse=lambda _c, why: self.refused.append(why),
                sock=sock,
            )
            conn.encryptor = getEncryptor(secret)
            conn.setOnMessageReceivedCallback(self.got[name].append)
            self.ends[name] = conn
        self.ends["d"]._dialled = True  # set by connect() for an outgoing connection
        self.kinds: list[str] = []  # how each message went: "session" or "fernet"

    def deliver(self, to: str) -> object:
        """Read the next message at ``to`` (noting how it was sent); what it decoded."""
        sock = self.socks[1 if to == "a" else 0]
        head = sock.recv(5, socket.MSG_PEEK)
        self.kinds.append("session" if head[4:5] == SESSION_MARK else "fernet")
        self.ends[to]._read()
        return self.got[to][-1] if self.got[to] else None

    def raw_next(self, to: str) -> bytes:
        """The next whole frame waiting at ``to``, left in place."""
        sock = self.socks[1 if to == "a" else 0]
        (length,) = struct.unpack("i", sock.recv(4, socket.MSG_PEEK))
        return sock.recv(4 + length, socket.MSG_PEEK)

    def handshake(self, *, check: bool = True, early: tuple[object, ...] = ()) -> None:
        """``early``: messages PySyncObj gives the dialler after its key, before the answer."""
        d, a = self.ends["d"], self.ends["a"]
        d.recvRandKey = b"D" * 32
        d.send(d.recvRandKey)
        for message in early:
            d.send(message)
        assert self.deliver("a") == b"D" * 32
        a.sendRandKey, a.recvRandKey = b"D" * 32, b"A" * 32
        a.send(a.recvRandKey)
        assert self.deliver("d") == b"A" * 32
        d.sendRandKey = b"A" * 32
        d.send("127.0.0.1:7310")
        self.deliver("a")
        assert self.got["a"][1:2] == ["127.0.0.1:7310"] or not check

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


SESSIONS = GuardLimits(session_secret=session_secret("s3cret"), send_sessions=True)
FERNET_ONLY = GuardLimits(session_secret=session_secret("s3cret"), send_sessions=False)


def test_after_the_handshake_both_ends_send_session_messages_each_read_in_order() -> None:
    link = Link(SESSIONS, SESSIONS)
    try:
        link.handshake()
        for i in range(3):
            link.ends["a"].send(APPEND)
            assert link.deliver("d") == APPEND
            link.ends["d"].send(("answer", i))
            assert link.deliver("a") == ("answer", i)
        # The two random keys go in Fernet (neither end has both yet); then sessions.
        assert link.kinds == ["fernet", "fernet"] + ["session"] * 7
        assert link.refused == []
    finally:
        link.close()


def test_what_pysyncobj_sends_before_the_acceptors_key_comes_back_waits_for_it() -> None:
    """PySyncObj hands a dialled connection Raft messages as soon as TCP connects. Sent before
    the acceptor's key came back they would not be wrapped in it, and the acceptor would refuse
    them and drop the connection; held, they follow the dialler's address, in order."""
    link = Link(SESSIONS, SESSIONS)
    try:
        link.handshake(early=(APPEND, ("request_vote", 4)))  # before the acceptor answered
        assert link.got["a"] == [b"D" * 32, "127.0.0.1:7310", APPEND, ("request_vote", 4)]
        assert link.refused == []
        assert link.kinds == ["fernet", "fernet", "session"]  # the first frame of each read
    finally:
        link.close()


def test_a_dialled_connection_never_answered_drops_itself_past_max_held() -> None:
    link = Link(SESSIONS, SESSIONS)
    try:
        d = link.ends["d"]
        d._state = 1  # CONNECTED, as after connect()
        d.recvRandKey = b"D" * 32
        d.send(d.recvRandKey)
        for i in range(MAX_HELD):
            d.send(("heartbeat", i))
        assert d.state == 1
        assert len(d._held) == MAX_HELD
        d.send("one more")
        assert d.state == 0  # DISCONNECTED: PySyncObj dials again
        assert d._held == []
    finally:
        link.close()


def test_a_peer_with_sessions_off_is_read_and_answered_in_kind() -> None:
    """Rolling a group onto sessions (``raft_session_cipher``): a dialler with them off is
    answered in Fernet (the acceptor waits for a session message first); a dialler with them
    on is read by an acceptor with them off, which answers in Fernet."""
    off_dials = Link(FERNET_ONLY, SESSIONS)
    on_dials = Link(SESSIONS, FERNET_ONLY)
    try:
        for link in (off_dials, on_dials):
            link.handshake()
            link.ends["a"].send(APPEND)
            assert link.deliver("d") == APPEND
            link.ends["d"].send("answer")
            assert link.deliver("a") == "answer"
            assert link.refused == []
        assert off_dials.kinds == ["fernet"] * 5
        assert on_dials.kinds == ["fernet", "fernet", "session", "fernet", "session"]
    finally:
        off_dials.close()
        on_dials.close()


def test_a_session_message_replayed_or_from_another_secret_closes_the_connection() -> None:
    link = Link(SESSIONS, SESSIONS)
    try:
        link.handshake()
        link.ends["d"].send("once")
        frame = link.raw_next("a")
        assert link.deliver("a") == "once"
        link.socks[0].sendall(frame)  # the same bytes again: its counter is behind
        link.ends["a"]._read()
        assert link.refused == ["a message that does not decrypt or decode"]
        assert link.got["a"] == [b"D" * 32, "127.0.0.1:7310", "once"]
    finally:
        link.close()
    other = Link(GuardLimits(session_secret=session_secret("other"), send_sessions=True), SESSIONS)
    try:
        other.handshake(check=False)  # the keys go in Fernet; its session key differs
        assert other.refused == ["a message that does not decrypt or decode"]
    finally:
        other.close()


def test_after_a_session_message_a_fernet_one_is_refused() -> None:
    link = Link(SESSIONS, SESSIONS)
    try:
        link.handshake()  # the acceptor has read a session message
        fernet = encode_message((b"A" * 32, "downgraded"), getEncryptor("s3cret"), 0)
        link.socks[0].sendall(struct.pack("i", len(fernet)) + fernet)
        link.ends["a"]._read()
        assert link.refused == ["a message that does not decrypt or decode"]
    finally:
        link.close()


def test_each_direction_of_each_connection_has_a_key_of_its_own() -> None:
    secret = session_secret("s3cret")
    nonce = bytes(12)
    d_to_a = session_key(secret, b"A" * 32, b"D" * 32).encrypt(nonce, b"m", SESSION_MARK)
    assert session_key(secret, b"A" * 32, b"D" * 32).decrypt(nonce, d_to_a, SESSION_MARK) == b"m"
    for sender, receiver in ((b"D" * 32, b"A" * 32), (b"A" * 32, b"E" * 32)):
        with pytest.raises(InvalidTag):
            session_key(secret, sender, receiver).decrypt(nonce, d_to_a, SESSION_MARK)
    assert session_secret("s3cret") != session_secret("s3cret2")
    assert MasterConfig().raft_session_cipher is True
