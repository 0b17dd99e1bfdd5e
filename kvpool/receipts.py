"""Commit receipts: the index's word on a write, which a store node can check without asking.

A store node publishes a staged block only with the version the index gave that write (a
PUBLISH frame's version is the sender's word, :mod:`kvpool.store_node.publish_check`). Asking
the leader costs a Lookup per put on both: about a fifth of the leader's and the node's CPU per
put, measured. So the leader that commits a put also signs it: the CommitPuts answer carries,
for each committed entry, a 64-bit keyed BLAKE2b tag of (key, write id, version) — the
*receipt* — and the writer copies it into its PUBLISH frame (the header's checksum field, unused
by PUBLISH, so an older node ignores it and asks the index as before). A node that holds the
key checks the tag and publishes at once with the frame's version; any doubt (no key, no
receipt, a tag that does not match) and it asks the index as before.

The key is derived from the masters' ``raft_secret`` (one-way: the key does not reveal it), so
every master signs alike and a new leader's receipts check with the same key; masters hand it
to store nodes when they register and with every heartbeat. A client is never sent it, so a
buggy writer cannot claim a version the index did not give: guessing a tag takes 2^63 PUBLISH
frames on average, and a wrong one only costs the Lookup that was asked before. (The cluster
token proves a node as it proves a client: whoever holds the token and registers as a node gets
the key — and, as such a node, the blocks placed on it. The key is no secret from the cluster's
members; it keeps a client's frames from speaking for the index.)
"""

from __future__ import annotations

import hashlib
import hmac
import struct

KEY_BYTES = 32
"""A receipt key's length (blake2b takes up to 64)."""
_CONTEXT = b"kvpool commit receipt v1"
_FIELDS = struct.Struct("<QQ")


def derive_key(raft_secret: str) -> bytes:
    """The receipt key of a master group whose ``raft_secret`` this is (b"" for none)."""
    if not raft_secret:
        return b""
    return hmac.digest(raft_secret.encode("utf-8"), _CONTEXT, "sha256")


def sign(key: bytes, key_bytes: bytes, write_id: int, version: int) -> int:
    """The receipt of ``(key_bytes, write_id, version)``: never 0 (0 is "no receipt")."""
    tag = hashlib.blake2b(
        _FIELDS.pack(write_id, version) + key_bytes, key=key, digest_size=8
    ).digest()
    return int.from_bytes(tag, "little") or 1


def check(key: bytes, key_bytes: bytes, write_id: int, version: int, receipt: int) -> bool:
    """Whether ``receipt`` is the index's signature of this write at this version (False
    without a key or a receipt)."""
    if not key or not receipt:
        return False
    return hmac.compare_digest(
        sign(key, key_bytes, write_id, version).to_bytes(8, "little"),
        receipt.to_bytes(8, "little"),
    )


def usable_key(raw: bytes) -> bytes:
    """A key from a master's answer, or b"" when it is not one (wrong length)."""
    return bytes(raw) if len(raw) == KEY_BYTES else b""
