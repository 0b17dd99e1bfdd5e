"""A block in pieces (kvpool.buffers.Parts): hashed, copied and sliced as the pieces joined."""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest

from kvpool import checksum
from kvpool.buffers import Parts, copy_bytes
from kvpool.checksum import (
    AHEAD_MIN_BYTES,
    SPLIT_COPY_BYTES,
    block_checksum,
    copy_checksum,
    hash_ahead,
)
from kvpool.client.plans import PutItem, with_checksums
from kvpool.client.values import as_into, as_value
from kvpool.errors import InvalidValueError, ValueTooLargeError


def pieces(data: bytes, cuts: list[int]) -> Parts:
    bounds = [0, *cuts, len(data)]
    return Parts([memoryview(bytearray(data[a:b])) for a, b in itertools.pairwise(bounds)])


@pytest.mark.parametrize("cuts", [[], [1], [5, 5, 6], [300_000, 300_001, 600_000]])
def test_pieces_hash_and_read_as_the_block_they_join(cuts: list[int]) -> None:
    data = os.urandom(700_000)
    parts = pieces(data, cuts)
    assert parts.nbytes == len(parts) == len(data)
    assert all(v.nbytes for v in parts.views)  # empty pieces are dropped
    assert bytes(parts) == data
    assert block_checksum(parts) == block_checksum(data)


@pytest.mark.parametrize(
    ("into", "out"), [([3], [7]), ([1, 2, 3], [699_999]), ([350_000], [100, 350_000, 350_001])]
)
def test_copies_scatter_and_gather_across_pieces_of_any_size(
    into: list[int], out: list[int]
) -> None:
    data = os.urandom(700_000)
    dest = pieces(bytes(len(data)), into)
    copy_bytes(dest, memoryview(data))
    assert bytes(dest) == data
    flat = memoryview(bytearray(len(data)))
    copy_bytes(flat, pieces(data, out))
    assert bytes(flat) == data
    both = pieces(bytes(len(data)), into)
    copy_bytes(both, pieces(data, out))
    assert bytes(both) == data
    with pytest.raises(ValueError, match="copy of"):
        copy_bytes(pieces(bytes(10), [4]), memoryview(bytes(11)))


def test_a_leading_slice_is_the_first_bytes() -> None:
    data = os.urandom(100)
    parts = pieces(data, [10, 50])
    assert parts[:100] is parts
    assert bytes(parts[:30]) == data[:30]
    assert bytes(parts[:10]) == data[:10]
    assert parts[:0].nbytes == 0
    with pytest.raises(TypeError):
        parts[5:10]


def test_a_value_or_buffer_in_pieces_is_checked_piece_by_piece() -> None:
    arr = np.arange(16, dtype=np.float32).reshape(2, 8)
    value = as_value([arr[0], b"xy", bytearray(3)], 1 << 20)
    assert isinstance(value, Parts)
    assert value.nbytes == 32 + 2 + 3
    assert np.shares_memory(np.frombuffer(value.views[0], dtype=np.uint8), arr)  # no copy
    assert isinstance(as_value([b"one piece"], 100), memoryview)
    assert as_value([], 100).nbytes == 0
    with pytest.raises(ValueTooLargeError):
        as_value([b"x" * 60, b"y" * 60], 100)  # the whole block counts
    with pytest.raises(InvalidValueError):
        as_value([b"x", "not bytes"], 100)
    sink = as_into([bytearray(4), np.zeros(3, dtype=np.int16)])
    assert isinstance(sink, Parts)
    assert sink.nbytes == 10
    with pytest.raises(InvalidValueError, match="read-only"):
        as_into([bytearray(4), b"read-only"])


@pytest.mark.parametrize("size", [0, 4096, 3 << 20, 4 << 20, (8 << 20) + 4097])
def test_copy_checksum_hashes_the_copy_split_or_not(size: int) -> None:
    data = os.urandom(size)
    dest = memoryview(bytearray(size))
    assert copy_checksum(dest, memoryview(data)) == block_checksum(data)
    assert bytes(dest) == data
    into = pieces(bytes(size), [size // 3]) if size else Parts([])
    assert copy_checksum(into, memoryview(data)) == block_checksum(data)  # pieces: not split
    assert bytes(into) == data


def test_split_copies_from_many_threads_each_get_their_own_bytes() -> None:
    """One helper serves one split copy at a time; the others copy alone, none waits for it."""
    size = SPLIT_COPY_BYTES + 4096
    blocks = [os.urandom(size) for _ in range(4)]
    out: dict[int, tuple[int, bytes]] = {}

    def read(i: int) -> None:
        dest = memoryview(bytearray(size))
        for _ in range(5):
            digest = copy_checksum(dest, memoryview(blocks[i]))
        out[i] = (digest, bytes(dest))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: (d, b == blocks[i]) for i, (d, b) in out.items()} == {
        i: (block_checksum(blocks[i]), True) for i in range(4)
    }
    assert any(t.name == "kvpool-copy" for t in threading.enumerate())


def test_a_failed_split_copy_raises_and_the_next_one_works() -> None:
    size = SPLIT_COPY_BYTES
    data = os.urandom(size)
    with pytest.raises(ValueError, match="read-only"):
        copy_checksum(memoryview(bytes(size)), memoryview(data))  # a read-only destination
    dest = memoryview(bytearray(size))
    assert copy_checksum(dest, memoryview(data)) == block_checksum(data)
    assert bytes(dest) == data


def test_a_split_copy_whose_helper_never_runs_is_made_by_the_caller_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper thread the scheduler has not run yet takes no piece: the caller copies them all
    and never waits for it (a fixed half once made readers wait ~0.8 ms for such a helper)."""
    idle = checksum._Helper(start=False)
    monkeypatch.setattr(checksum, "_HELPER", idle)
    data = os.urandom(SPLIT_COPY_BYTES + 4096)  # three pieces
    dest = memoryview(bytearray(len(data)))
    assert copy_checksum(dest, memoryview(data)) == block_checksum(data)
    assert bytes(dest) == data
    assert idle.skip == 0  # it did not wait: no back-off


def test_a_helper_slower_than_the_caller_is_left_out_of_the_next_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper with no CPU (another process busy, the GIL held elsewhere) made a 4 MiB read
    ~4x slower than the caller alone: after a split copy that waited for it, the next
    SPLIT_BACKOFF_COPIES copies are the caller's alone — and still right."""
    helper = checksum._Helper()
    monkeypatch.setattr(checksum, "_HELPER", helper)
    helped = []

    def slow_in_helper(dest: memoryview, src: memoryview) -> None:
        if threading.current_thread().name == "kvpool-copy":
            helped.append(dest.nbytes)
            threading.Event().wait(0.05)  # descheduled mid-piece
        copy_bytes(dest, src)

    monkeypatch.setattr(checksum, "copy_bytes", slow_in_helper)
    data = os.urandom(2 * SPLIT_COPY_BYTES)
    dest = memoryview(bytearray(len(data)))
    for _ in range(200):  # until the helper took a piece (it may wake after the caller's end)
        assert copy_checksum(dest, memoryview(data)) == block_checksum(data)
        if helped:
            break
    assert helped
    assert helper.skip == checksum.SPLIT_BACKOFF_COPIES
    taken = len(helped)
    for _i in range(checksum.SPLIT_BACKOFF_COPIES):
        dest[:] = bytes(len(data))
        assert copy_checksum(dest, memoryview(data)) == block_checksum(data)
        assert bytes(dest) == data
    assert len(helped) == taken
    assert helper.skip == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_splits_copies_with_a_helper_of_its_own() -> None:
    data = os.urandom(SPLIT_COPY_BYTES)
    copy_checksum(memoryview(bytearray(len(data))), memoryview(data))  # the parent's helper runs
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if its split copy hashes and copies right
        ok = False
        try:
            dest = memoryview(bytearray(len(data)))
            ok = copy_checksum(dest, memoryview(data)) == block_checksum(data)
            ok = ok and bytes(dest) == data
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _ahead_blocks() -> list[object]:
    return [
        memoryview(os.urandom(size)) for size in (AHEAD_MIN_BYTES, 1 << 20, 5, (1 << 20) + 3)
    ] + [pieces(os.urandom(600_000), [200_000])]


@pytest.mark.parametrize("order", ["forward", "backward", "two threads"])
def test_blocks_hashed_ahead_have_the_checksums_hashed_alone(order: str) -> None:
    blocks = _ahead_blocks() * 4
    ahead = hash_ahead(blocks)
    got: dict[int, int] = {}
    try:
        if order == "forward":
            got = {i: ahead.get(i) for i in range(len(blocks))}
        elif order == "backward":
            got = {i: ahead.get(i) for i in reversed(range(len(blocks)))}
        else:
            other = threading.Thread(target=lambda: got.update({0: ahead.get(0), 7: ahead.get(7)}))
            other.start()
            got.update({i: ahead.get(i) for i in range(len(blocks))})
            other.join()
    finally:
        ahead.close()
    assert got == {i: block_checksum(b) for i, b in enumerate(blocks)}


def test_blocks_whose_helper_never_runs_are_hashed_by_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper thread the scheduler has not run (another process on the other core): the caller
    hashes every block and never waits for it, and closing does not wait either."""
    monkeypatch.setattr(checksum, "_AHEAD", checksum._AheadHelper(start=False))
    blocks = _ahead_blocks()
    ahead = hash_ahead(blocks)
    assert [ahead.get(i) for i in range(len(blocks))] == [block_checksum(b) for b in blocks]
    ahead.close()


def test_closing_waits_for_the_block_in_the_helper_and_lets_the_caller_have_its_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put returns only once the helper holds none of its buffers: a caller's bytearray can be
    resized at once (an exported buffer cannot be)."""
    in_helper = threading.Event()
    real = checksum._hash_unlocked

    def slow_in_helper(data: object) -> int:
        if threading.current_thread().name == "kvpool-hash":
            in_helper.set()
            threading.Event().wait(0.1)  # descheduled mid-hash
        return real(data)

    monkeypatch.setattr(checksum, "_hash_unlocked", slow_in_helper)
    owned = [bytearray(os.urandom(AHEAD_MIN_BYTES)) for _ in range(3)]
    ahead = hash_ahead([memoryview(b) for b in owned])
    assert ahead.get(0) == block_checksum(owned[0])
    assert in_helper.wait(5)
    ahead.close()
    for b in owned:
        b.extend(b"x")  # raises BufferError while any view of it is still held


def test_a_block_that_cannot_be_hashed_fails_in_the_callers_thread() -> None:
    blocks = _ahead_blocks()
    gone = memoryview(bytearray(AHEAD_MIN_BYTES))
    gone.release()
    blocks.insert(1, gone)
    ahead = hash_ahead(blocks)
    try:
        assert ahead.get(0) == block_checksum(blocks[0])
        with pytest.raises(ValueError, match="released"):
            ahead.get(1)
        assert ahead.get(2) == block_checksum(blocks[2])
    finally:
        ahead.close()


def test_a_block_that_cannot_be_hashed_fails_only_the_call_that_asks_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the helper hashes block 0, the caller asking for it hashes the last free block
    meanwhile; when that one cannot be hashed, asking for block 0 still answers, and the error
    comes with the bad block's own turn."""
    in_helper = threading.Event()
    real = checksum._hash_unlocked

    def slow_in_helper(data: object) -> int:
        if threading.current_thread().name == "kvpool-hash":
            in_helper.set()
            threading.Event().wait(0.1)
        return real(data)

    monkeypatch.setattr(checksum, "_hash_unlocked", slow_in_helper)
    good = [memoryview(os.urandom(AHEAD_MIN_BYTES)) for _ in range(3)]
    gone = memoryview(bytearray(AHEAD_MIN_BYTES))
    gone.release()
    ahead = hash_ahead([*good, gone])
    try:
        assert in_helper.wait(5)  # the helper holds block 0
        assert ahead.get(0) == block_checksum(good[0])
        assert [ahead.get(i) for i in (1, 2)] == [block_checksum(g) for g in good[1:]]
        with pytest.raises(ValueError, match="released"):
            ahead.get(3)
    finally:
        ahead.close()


def test_a_reservations_checksums_are_each_blocks_own_and_a_stopped_one_holds_no_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """with_checksums (the checksums a shared-memory reservation lists, big blocks hashed with
    the helper's help): each item's is its own block's; a put stopped midway (an error between
    two items) leaves the helper holding none of the caller's buffers."""
    sizes = (4096, 1 << 20, AHEAD_MIN_BYTES, 7, (1 << 20) + 1)
    payloads = [bytearray(os.urandom(n)) for n in sizes * 3]
    items = [PutItem(f"k{i}", f"k{i}".encode(), memoryview(p)) for i, p in enumerate(payloads)]
    assert [it.checksum for it in with_checksums(items)] == [block_checksum(p) for p in payloads]

    real = checksum._hash_unlocked

    def slow_in_helper(data: object) -> int:
        if threading.current_thread().name == "kvpool-hash":
            threading.Event().wait(0.02)  # a helper with little CPU
        return real(data)

    monkeypatch.setattr(checksum, "_hash_unlocked", slow_in_helper)
    fresh = [PutItem(f"k{i}", f"k{i}".encode(), memoryview(p)) for i, p in enumerate(payloads)]
    walk = with_checksums(fresh)
    first = next(walk)
    assert first.checksum == block_checksum(payloads[0])
    walk.close()
    del items, fresh, first, walk  # the caller's own views gone: only a helper's would be left
    for p in payloads:
        p.extend(b"x")  # raises BufferError while any view of it is still held
