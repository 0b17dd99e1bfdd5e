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
    SHARED_HASH_MIN_BYTES,
    SPLIT_COPY_BYTES,
    block_checksum,
    block_checksums,
    copy_checksum,
)
from kvpool.client.plans import PutItem, make_checksums
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


def _big_and_small() -> list[memoryview | Parts]:
    return [
        memoryview(os.urandom(size))
        for size in (SHARED_HASH_MIN_BYTES, 1 << 20, 5, (1 << 20) + 3, SHARED_HASH_MIN_BYTES - 1)
    ] + [pieces(os.urandom(600_000), [200_000])]


def test_checksums_shared_with_the_helper_are_those_hashed_alone() -> None:
    """Two threads at once: one shares its blocks with the helper, the other (finding it busy)
    hashes alone; every checksum is its block's either way."""
    lists = [_big_and_small() * 3 for _ in range(2)]
    out: dict[int, list[int]] = {}

    def run(n: int) -> None:
        for _ in range(5):
            out[n] = block_checksums(lists[n])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {n: [block_checksum(b) for b in lists[n]] for n in range(2)}
    assert block_checksums([]) == []


def test_checksums_whose_helper_never_runs_are_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper thread the scheduler has not run (another process on the other core): the caller
    hashes every block and never waits for it."""
    idle = checksum._Helper(start=False)
    monkeypatch.setattr(checksum, "_HELPER", idle)
    blocks = _big_and_small()
    assert block_checksums(blocks) == [block_checksum(b) for b in blocks]
    assert idle.skip == 0  # it did not wait: no back-off


def test_shared_hashing_returns_only_once_the_helper_holds_no_buffer_of_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put returns only once the helper holds none of its buffers: a caller's bytearray can be
    resized at once (an exported buffer cannot be)."""
    helped = []
    real = checksum._hash_unlocked

    def slow_in_helper(data: memoryview | Parts) -> int:
        if threading.current_thread().name == "kvpool-copy":
            helped.append(data.nbytes)
            threading.Event().wait(0.05)  # descheduled mid-hash
        return real(data)

    monkeypatch.setattr(checksum, "_HELPER", checksum._Helper())
    monkeypatch.setattr(checksum, "_hash_unlocked", slow_in_helper)
    for _ in range(200):  # until the helper took a block (it may wake after the caller's end)
        owned = [bytearray(os.urandom(SHARED_HASH_MIN_BYTES)) for _ in range(8)]
        views = [memoryview(b) for b in owned]
        assert block_checksums(views) == [block_checksum(b) for b in owned]  # type: ignore[arg-type]
        checksum._HELPER.skip = 0  # type: ignore[union-attr]
        if helped:
            break
    assert helped
    del views
    for b in owned:
        b.extend(b"x")  # raises BufferError while any view of it is still held


def test_a_block_that_cannot_be_hashed_raises_and_the_next_call_works() -> None:
    blocks = _big_and_small()
    gone = memoryview(bytearray(SHARED_HASH_MIN_BYTES))
    gone.release()
    with pytest.raises(ValueError, match="released"):
        block_checksums([blocks[0], gone, blocks[1]])
    assert block_checksums(blocks) == [block_checksum(b) for b in blocks]


def test_a_reservations_items_get_their_own_blocks_checksums() -> None:
    """make_checksums (the checksums a shared-memory reservation lists): each item's is its own
    block's, big or small; one already made is kept."""
    payloads = [os.urandom(n) for n in (4096, 1 << 20, SHARED_HASH_MIN_BYTES, 7)] * 3
    items = [PutItem(f"k{i}", f"k{i}".encode(), memoryview(p)) for i, p in enumerate(payloads)]
    assert items[1].checksum == block_checksum(payloads[1])  # made before: kept
    make_checksums(items)
    assert [it._checksum for it in items] == [block_checksum(p) for p in payloads]
