"""Commit receipts (kvpool.receipts): the leader's signature a node checks instead of asking."""

from __future__ import annotations

import pytest

from kvpool import receipts
from kvpool.store_node.publish_check import IndexVersions


def test_every_master_of_a_group_derives_the_same_key_and_another_group_another() -> None:
    key = receipts.derive_key("a-raft-secret-of-the-group")
    assert len(key) == receipts.KEY_BYTES
    assert key == receipts.derive_key("a-raft-secret-of-the-group")
    assert key != receipts.derive_key("another-group's-secret")
    assert b"a-raft-secret" not in key
    assert receipts.derive_key("") == b""  # no secret, no receipts


def test_a_receipt_checks_only_for_the_write_and_version_it_was_given_for() -> None:
    key = receipts.derive_key("s" * 32)
    r = receipts.sign(key, b"kv1/abc", 7, 12)
    assert r != 0
    assert receipts.check(key, b"kv1/abc", 7, 12, r)
    assert not receipts.check(key, b"kv1/abd", 7, 12, r)  # another key
    assert not receipts.check(key, b"kv1/abc", 8, 12, r)  # another write
    assert not receipts.check(key, b"kv1/abc", 7, 2**64 - 1, r)  # a version claimed higher
    assert not receipts.check(key, b"kv1/abc", 7, 12, r ^ 1)  # a tag off by one bit
    assert not receipts.check(receipts.derive_key("t" * 32), b"kv1/abc", 7, 12, r)
    assert not receipts.check(b"", b"kv1/abc", 7, 12, r)  # a node without the key
    assert not receipts.check(key, b"kv1/abc", 7, 12, 0)  # no receipt


@pytest.mark.parametrize("raw", [b"", b"short", bytes(31), bytes(33), bytes(64)])
def test_a_key_of_another_length_from_a_master_is_not_used(raw: bytes) -> None:
    assert receipts.usable_key(raw) == b""


def test_a_key_of_the_right_length_is_used() -> None:
    assert receipts.usable_key(bytes(range(32))) == bytes(range(32))


def test_a_node_keeps_its_key_when_a_master_answers_none_and_takes_a_changed_one() -> None:
    versions = IndexVersions(masters=None, timeout_s=1.0)  # type: ignore[arg-type]
    old, new = receipts.derive_key("x" * 32), receipts.derive_key("y" * 32)
    versions.learn_key(old)
    assert versions.proves(b"k", 1, 2, receipts.sign(old, b"k", 1, 2))
    versions.learn_key(b"")  # a master of an older release
    versions.learn_key(b"not a key")
    assert versions.receipt_key == old
    versions.learn_key(new)  # the masters' raft_secret was changed
    assert not versions.proves(b"k", 1, 2, receipts.sign(old, b"k", 1, 2))
    assert versions.proves(b"k", 1, 2, receipts.sign(new, b"k", 1, 2))
