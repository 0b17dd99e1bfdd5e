"""The index's prefix removal (RemoveKeys.prefixes): what a namespace- or cluster-wide removal
takes, in steps of at most ``limit`` keys, the same keys on every master."""

from __future__ import annotations

import pickle

from kvpool.raft_master.commands import (
    RemoveKeys,
    RemoveKeysResult,
    SetPins,
    decode,
    decode_result,
    encode,
    encode_result,
)
from kvpool.raft_master.index import BlockIndex, IndexSnapshot
from tests.unit.test_index import put, register, rid


def removed_keys(result: RemoveKeysResult) -> set[str]:
    return {b.key for b in result.blocks}


def test_a_prefix_removes_only_its_keys_and_says_when_more_are_left() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    for i in range(10):
        put(index, f"mooncake/a/{i}", i + 1, (m,))
    put(index, "mooncake/ab/x", 100, (m,))  # "mooncake/ab/" is not under "mooncake/a/"
    put(index, "native/1", 101, (m,))
    first = index.apply(RemoveKeys(rid(), (), ("mooncake/a/",), 4))
    assert isinstance(first, RemoveKeysResult)
    assert (first.prefix_removed, first.more, first.removed) == (4, True, ())
    assert all(k.startswith("mooncake/a/") for k in removed_keys(first))
    rest = index.apply(RemoveKeys(rid(), (), ("mooncake/a/",), 6))
    assert isinstance(rest, RemoveKeysResult)
    assert (rest.prefix_removed, rest.more) == (6, False)
    assert index.lookup(["mooncake/ab/x", "native/1"])[0] is not None
    assert index.lookup(["native/1"])[0] is not None
    assert all(v is None for v in index.lookup([f"mooncake/a/{i}" for i in range(10)]))
    empty = index.apply(RemoveKeys(rid(), (), ("mooncake/a/",), 4))
    assert isinstance(empty, RemoveKeysResult)
    assert (empty.prefix_removed, empty.more, empty.blocks) == (0, False, ())
    index.check_invariants()


def test_the_empty_prefix_is_every_key_and_pins_go_with_their_keys() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    for i in range(5):
        put(index, f"k{i}", i + 1, (m,))
    index.apply(SetPins(rid(), ("k1",), 1, 0))
    result = index.apply(RemoveKeys(rid(), ("k0",), ("",), 0))
    assert isinstance(result, RemoveKeysResult)
    assert result.removed == (True,)
    assert result.prefix_removed == 4  # k0 went by name
    assert removed_keys(result) == {f"k{i}" for i in range(5)}
    assert index.lookup(["k1"]) == [None]
    index.check_invariants()


def test_every_master_removes_the_same_keys_also_after_a_snapshot() -> None:
    """Masters apply the same log; one that restored a snapshot midway must pick the same
    keys for a limited step as one that applied everything."""
    a = BlockIndex()
    m = register(a, "n1")
    for i in range(50):
        put(a, f"p/{(i * 37) % 50}", i + 1, (m,))
    b = BlockIndex.import_state(pickle.loads(pickle.dumps(IndexSnapshot(a.export_state()))))
    command = RemoveKeys(rid(), (), ("p/",), 7)
    wire = decode(encode(command))
    assert wire == command
    ra, rb = a.apply(command), b.apply(wire)
    assert isinstance(ra, RemoveKeysResult)
    assert isinstance(rb, RemoveKeysResult)
    assert removed_keys(ra) == removed_keys(rb)
    assert a.canonical_state() == b.canonical_state()
    assert decode_result(encode_result(ra)) == ra
