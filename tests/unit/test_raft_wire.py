"""What our Raft connections send is what a plain PySyncObj peer reads, at any zlib level."""

from __future__ import annotations

import struct

import pytest
from pysyncobj.encryptor import getEncryptor
from pysyncobj.poller import createPoller
from pysyncobj.tcp_connection import TcpConnection

from kvpool.config import MasterConfig, load_config
from kvpool.errors import ConfigError
from kvpool.raft_master.raft_guard import GuardedConnection, GuardLimits, encode_message

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
