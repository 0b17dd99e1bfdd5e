"""The shared directory of a node's in-memory blocks: its layout, the node's listing, and a
client's reads through it — a block read with no message is the exact bytes of a committed
write of that key, or no read at all."""

from __future__ import annotations

import mmap
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.checksum import block_checksum
from kvpool.client.links import _node_alive
from kvpool.client.plans import ReadItem, read_listed
from kvpool.proto.keys import is_scheme_key
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import Status, TierLevel
from kvpool.store_node.block_store import BlockStore
from kvpool.transports import directory as layout
from kvpool.transports.directory import (
    BUCKET_SLOTS,
    DirectoryReader,
    DirectoryWriter,
    fingerprint,
    slots_for,
)
from kvpool.transports.shm import PREAMBLE, SHM_MAGIC, Arena, shm_supported
from tests.unit.listing import Probe
from tests.unit.test_block_store import FakeClock, commit, data_for, make_store, stage
from tests.unit.test_transports import Node

pytestmark = pytest.mark.skipif(not shm_supported(), reason="shared memory needs Linux (memfd)")
KIB = 1024


@pytest.fixture
def pair() -> Iterator[tuple[DirectoryWriter, DirectoryReader]]:
    writer = DirectoryWriter(1024)
    writer.beat()
    reader = DirectoryReader(writer.fd, writer.hits_fd)
    yield writer, reader
    reader.close()
    writer.close()


def same_bucket_keys(buckets: int, n: int) -> list[bytes]:
    """``n`` keys whose fingerprints fall in bucket 0 of ``buckets``."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = f"k/{i}".encode()
        if int.from_bytes(fingerprint(key)[:8], "little") % buckets == 0:
            out.append(key)
        i += 1
    return out


# --- the layout ---------------------------------------------------------------------------------


def test_a_listed_block_is_found_with_what_was_listed_and_no_longer_once_dropped(
    pair: tuple[DirectoryWriter, DirectoryReader],
) -> None:
    writer, reader = pair
    slot = writer.put(b"kv1/a", 4096, 1000, 0xABC, 7)
    assert slot >= 0
    found = reader.find(b"kv1/a")
    assert found == (slot, 4096, 1000, 0xABC, 7)
    assert reader.find(b"kv1/b") is None
    writer.drop(slot)
    assert reader.find(b"kv1/a") is None
    assert writer.listed == 0


def test_a_full_bucket_takes_no_more_and_a_dropped_slot_is_used_again() -> None:
    writer = DirectoryWriter(BUCKET_SLOTS * 4)
    reader = DirectoryReader(writer.fd, writer.hits_fd)
    try:
        keys = same_bucket_keys(4, BUCKET_SLOTS + 1)
        slots = [writer.put(k, i, 1, i, i + 1) for i, k in enumerate(keys[:BUCKET_SLOTS])]
        assert sorted(slots) == list(range(BUCKET_SLOTS))
        assert writer.put(keys[-1], 99, 1, 99, 99) == -1  # full: read through the node
        writer.drop(slots[3])
        assert writer.put(keys[-1], 99, 1, 99, 99) == slots[3]
        for i, key in enumerate(keys[:BUCKET_SLOTS]):
            found = reader.find(key)
            assert (found is None) if i == 3 else (found is not None and found.offset == i)
        assert reader.find(keys[-1]) == (slots[3], 99, 1, 99, 99)
    finally:
        reader.close()
        writer.close()


def test_a_slot_whose_bytes_do_not_match_its_tag_is_not_taken(
    pair: tuple[DirectoryWriter, DirectoryReader],
) -> None:
    writer, reader = pair
    slot = writer.put(b"kv1/a", 4096, 1000, 0xABC, 7)
    pos = layout.HEADER_BYTES + slot * layout.SLOT_BYTES
    writer._map[pos + 16] ^= 0xFF  # the offset half rewritten, as a reader may catch it
    assert reader.find(b"kv1/a") is None
    writer._map[pos + 16] ^= 0xFF
    assert reader.find(b"kv1/a") is not None


def test_a_directory_its_node_stopped_renewing_is_not_read(
    pair: tuple[DirectoryWriter, DirectoryReader],
) -> None:
    writer, reader = pair
    assert reader.alive()
    writer.beat(0)  # shut down
    assert not reader.alive()
    writer.beat(0.05)
    assert reader.alive()
    time.sleep(0.1)  # killed or stopped: nobody renews it
    assert not reader.alive()


def test_clients_map_the_directory_read_only_and_count_reads_the_node_takes_once(
    pair: tuple[DirectoryWriter, DirectoryReader],
) -> None:
    writer, reader = pair
    if writer.sealed:
        with pytest.raises(PermissionError):
            mmap.mmap(writer.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    slot = writer.put(b"kv1/a", 0, 10, 1, 1)
    for _ in range(3):
        reader.count_read(slot)
    assert writer.take_reads() == [(slot, 3)]
    assert writer.take_reads() == []
    reader._hits[:] = 0xFFFFFFFF  # a client scribbling over the counters: only listed slots
    assert writer.take_reads() == [(slot, layout.MAX_READS_PER_TAKE)]  # count, and not beyond
    assert writer.take_reads() == []


def test_one_take_credits_a_bounded_number_of_slots_the_most_read() -> None:
    writer = DirectoryWriter(1 << 15)
    try:
        n = layout.MAX_SLOTS_PER_TAKE + 100
        slots = [writer.put(f"k/{i}".encode(), i, 1, i, 1) for i in range(n * 2)]
        listed = [s for s in slots if s >= 0][:n]
        assert len(listed) == n
        for rank, slot in enumerate(listed):
            writer.hits[slot] = rank + 1
        taken = writer.take_reads()
        assert len(taken) == layout.MAX_SLOTS_PER_TAKE
        assert min(count for _, count in taken) == 101  # the 100 least read left out
        assert not writer.hits.any()
    finally:
        writer.close()


def test_reads_counted_while_the_node_takes_them_are_credited_and_break_nothing() -> None:
    """Clients (other processes) count into the shared memory while the node takes the
    counts: the take works on one copy of them (numpy's nonzero failed when a count appeared
    between its two passes, and that ended the node's directory beats)."""
    writer = DirectoryWriter(1 << 15)
    slots = [s for s in (writer.put(f"k/{i}".encode(), i, 1, i, 1) for i in range(4000)) if s >= 0]
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a client process, counting as fast as it can for a second
        code = 1
        try:
            reader = DirectoryReader(writer.fd, writer.hits_fd)
            counted, i, end = 0, 0, time.monotonic() + 1.0
            while time.monotonic() < end:
                reader.count_read(slots[i % len(slots)])
                counted, i = counted + 1, i + 7
            os.write(done_w, counted.to_bytes(8, "little"))
            code = 0
        finally:
            os._exit(code)
    os.close(done_w)
    credited = 0
    try:
        while not select.select([done_r], [], [], 0)[0]:
            credited += sum(n for _, n in writer.take_reads())
        counted = int.from_bytes(os.read(done_r, 8), "little")
        credited += sum(n for _, n in writer.take_reads())
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(done_r)
        writer.close()
    assert os.waitstatus_to_exitcode(status) == 0
    # A count that races the node's reset may be lost (or, a client writing back what it read
    # before the reset, counted again): hints for the eviction policy, off by a hair at most.
    assert counted > 0
    assert abs(credited - counted) <= counted // 100


def test_a_read_counted_while_the_node_takes_the_counts_is_credited_at_the_next_take() -> None:
    """A client's count that lands after the node copied the counts is not wiped by the take:
    the take subtracts what it saw, so the read is credited next time (zeroing lost up to ~1 %
    of the reads under load); a count a client wrote back below what was seen does not wrap."""
    import numpy as np

    writer = DirectoryWriter(1 << 10)
    try:
        a, b = writer.put(b"k/a", 1, 1, 1, 1), writer.put(b"k/b", 2, 1, 2, 1)
        reader = DirectoryReader(writer.fd, writer.hits_fd)
        for _ in range(3):
            reader.count_read(a)
        reader.count_read(b)
        hits = writer.hits

        class CountsAfterCopy(np.ndarray):
            def copy(self, order: Any = "C") -> Any:
                seen = np.asarray(self).copy(order)
                reader.count_read(a)  # a client counts right after the node's copy
                hits[b] = 0  # and another writes back a count from before the copy
                return seen

        writer.hits = hits.view(CountsAfterCopy)
        assert sorted(writer.take_reads()) == sorted([(a, 3), (b, 1)])
        writer.hits = hits
        assert int(hits[b]) == 0  # not wrapped around to ~4 billion
        assert writer.take_reads() == [(a, 1)]
        assert writer.take_reads() == []
        reader.close()
    finally:
        writer.close()


def test_a_beat_that_fails_does_not_end_the_nodes_beats() -> None:
    """One failed renewal is logged and the next beat comes as usual: were the beats to end,
    every same-host client would stop reading through the directory a second later."""
    node = Node()
    reader = None
    try:
        directory = node.server._shm.directory
        assert directory is not None
        real, beats = directory.tend, []

        def tend() -> None:
            beats.append(time.monotonic())
            if len(beats) == 1:
                raise RuntimeError("a count changed under the take")
            real()

        directory.tend = tend
        reader = DirectoryReader(directory.writer.fd, directory.writer.hits_fd)
        time.sleep(layout.ALIVE_S + 0.5)
        assert len(beats) > 2
        assert reader.alive()
    finally:
        if reader is not None:
            reader.close()
        node.close()


def test_a_memfd_that_is_not_a_directory_is_refused() -> None:
    fd = os.memfd_create("not-a-directory")
    try:
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(ValueError, match="not a kvpool directory"):
            DirectoryReader(fd, fd)
        # A header declaring more slots than any node makes, with a file to match: refused
        # before the counters are mapped.
        slots = layout.MAX_SLOTS * 2
        os.ftruncate(fd, layout.HEADER_BYTES + slots * layout.SLOT_BYTES)
        os.pwrite(fd, layout.HEADER.pack(layout.MAGIC, slots, 0), 0)
        counters = os.memfd_create("counters")
        try:
            os.ftruncate(counters, slots * 4)
            with pytest.raises(ValueError, match="not a kvpool directory of this layout"):
                DirectoryReader(fd, counters)
        finally:
            os.close(counters)
    finally:
        os.close(fd)


def test_slots_grow_with_the_arena_within_their_limits() -> None:
    assert slots_for(1 << 20) == layout.MIN_SLOTS
    assert slots_for(1 << 30) == 65536
    assert slots_for(1 << 44) == layout.MAX_SLOTS
    assert slots_for(3 << 30) == 262144  # a power of two


# --- the node's listing ---------------------------------------------------------------------------


def test_the_node_lists_committed_blocks_in_memory_and_unlists_them_as_they_go() -> None:
    clock = FakeClock()
    store = make_store(clock, capacity=64 * KIB)
    probe = Probe(store)
    try:
        assert stage(store, "staged", 1) == Status.OK
        assert probe.read("staged") is None  # staged: its commit is not known
        assert commit(store, "a", 5, 1) == Status.OK
        assert probe.read("a") == (5, data_for("a", 5, 4 * KIB))
        assert commit(store, "a", 6, 2) == Status.OK  # a newer write replaces it
        assert probe.read("a") == (6, data_for("a", 6, 4 * KIB))
        probe.check()
        store.delete("a", 0)
        assert probe.read("a") is None
        for i in range(20):  # pressure evicts the oldest
            assert commit(store, f"k{i}", 1, 10 + i) == Status.OK
            store.evict_if_needed()
        probe.check()
        assert probe.read("k0") is None
        assert store.stats().evictions > 0
        probe.check()
    finally:
        probe.close()
        store.tier.close()


def test_reads_through_the_directory_count_as_the_nodes_own() -> None:
    store = make_store(FakeClock())
    probe = Probe(store)
    try:
        assert commit(store, "hot", 1, 1) == Status.OK
        hits = store.stats().hits
        for _ in range(5):
            assert probe.read("hot") is not None
        probe.directory.tend()
        assert store.stats().hits == hits + 5
        assert dict(store.take_read_counts(10)) == {"hot": 5}
    finally:
        probe.close()
        store.tier.close()


# --- a client's reads through it -----------------------------------------------------------------


def listed_arena(
    values: dict[str, bytes],
) -> tuple[BlockStore, Probe, Arena]:
    store = make_store(FakeClock(), capacity=256 * KIB, max_block=128 * KIB)
    for i, (key, value) in enumerate(values.items()):
        verdict = store.reserve(key, 100 + i, len(value), block_checksum(value))
        assert verdict.block is not None
        store.view(verdict.block)[:] = value
        assert store.finish_put(verdict.block) == Status.OK
        assert store.publish(key, 100 + i, i + 1).status == Status.OK
    probe = Probe(store)
    fd = store.tier.fd
    assert fd is not None
    writer = probe.directory.writer
    reader = DirectoryReader(writer.fd, writer.hits_fd)
    return store, probe, Arena(os.dup(fd), store.tier.capacity_bytes, b"t" * 16, reader)


def item(key: str, write_id: int, size: int, checksum: int, sink: bool) -> ReadItem:
    entry = common_pb2.BlockEntry(
        key=key, found=True, write_id=write_id, size_bytes=size, checksum=checksum, replicas=[1]
    )
    buf = memoryview(bytearray(size)) if sink else None
    return ReadItem(key, key.encode(), entry, sink=buf, caller_buffer=sink, replicas=[1])


def test_a_client_reads_listed_blocks_and_leaves_the_rest_to_the_node() -> None:
    values = {"a": os.urandom(5000), "b": os.urandom(70_000), "c": os.urandom(10)}
    store, probe, arena = listed_arena(values)
    try:
        a = item("a", 100, 5000, block_checksum(values["a"]), sink=True)
        b = item("b", 0, 0, 0, sink=False)  # by content: any write, any size
        stale = item("c", 99, 10, block_checksum(values["c"]), sink=False)  # another write
        absent = item("d", 0, 0, 0, sink=False)
        gpu_only = item("a", 100, 5000, block_checksum(values["a"]), sink=False)
        gpu_only.max_tier = TierLevel.GPU
        cached = item("a", 100, 5000, block_checksum(values["a"]), sink=False)
        cached.from_cache = True  # may name a replaced write: the node judges it
        rest = read_listed([a, b, stale, absent, gpu_only, cached], arena)
        assert rest == [stale, absent, gpu_only, cached]
        assert a.ok
        assert a.sink is not None
        assert bytes(a.sink) == values["a"]
        assert b.ok
        assert b.result() == values["b"]
        assert b.tier == TierLevel.CPU
        assert (b.entry.write_id, b.entry.size_bytes) == (101, 70_000)
        assert not stale.ok
        assert not stale.reasons
        # The block's memory reused under the listing (the node freed it, a put came): the
        # copy does not check, so the read goes to the node — never those bytes.
        block = store.block("a", 100)
        assert block is not None
        store.tier.view(block.offset, 5000)[:100] = b"\0" * 100
        again = item("a", 100, 5000, block_checksum(values["a"]), sink=True)
        assert read_listed([again], arena) == [again]
        assert not again.ok
        # A listing that points outside the arena is left to the node, never read.
        writer = probe.directory.writer
        writer.put(b"far", arena.size - 10, 100, 0, 1)
        far = item("far", 0, 0, 0, sink=False)
        assert read_listed([far], arena) == [far]
        assert not far.ok
        assert not far.reasons
    finally:
        arena.close()
        probe.close()
        store.tier.close()


def test_a_cached_entry_of_a_key_that_names_its_content_is_read_through_the_directory() -> None:
    """A client reading back the blocks it put itself holds their entries in its cache. For an
    opaque key the node judges such a read (the entry may name a replaced write); a key that
    names its content has no replaced value — every write of it holds the same bytes — so the
    directory serves it, whichever write it lists (its bytes still checked). Without
    ``content`` (``direct_reads="off"``) it goes to the node as before."""
    key = f"kv1/{'a' * 32}/{'b' * 32}"
    value = os.urandom(5000)
    store, probe, arena = listed_arena({key: value, "opaque": value})
    digest = block_checksum(value)
    try:

        def cached(name: str, write_id: int) -> ReadItem:
            it = item(name, write_id, 5000, digest, sink=True)
            it.from_cache = True
            return it

        mine = cached(key, 100)  # the listed write
        older = cached(key, 42)  # another write of the same content
        opaque = cached("opaque", 101)
        names_content = is_scheme_key
        assert read_listed([mine, older, opaque], arena, names_content) == [opaque]
        assert mine.ok
        assert older.ok
        assert mine.sink is not None
        assert older.sink is not None
        assert bytes(mine.sink) == bytes(older.sink) == value
        assert (older.entry.write_id, older.tier) == (42, TierLevel.CPU)  # the entry as cached
        assert not opaque.ok
        # The listing's checksum is not the entry's: the node judges it, nothing is taken.
        odd = item(key, 100, 5000, digest ^ 1, sink=True)
        odd.from_cache = True
        assert read_listed([odd], arena, names_content) == [odd]
        assert not odd.ok
        # direct_reads="off": no key is taken to name its content.
        off = cached(key, 100)
        assert read_listed([off], arena, None) == [off]
        assert not off.ok
    finally:
        arena.close()
        probe.close()
        store.tier.close()


def test_a_node_that_closed_the_connection_is_not_read_through_its_directory() -> None:
    store, probe, arena = listed_arena({"a": b"x" * 100})
    mine, theirs = socket.socketpair()
    try:

        class Conn:
            socket = mine

        assert _node_alive(arena, Conn())
        theirs.sendall(b"posted answer")  # an answer waiting: alive
        assert _node_alive(arena, Conn())
        theirs.close()  # the node died, its answer still unread here: the kernel closed its end...
        deadline = time.monotonic() + 5
        while _node_alive(arena, Conn()):  # ...once no process holds it (a fork in flight may)
            assert time.monotonic() < deadline, "a closed connection still counts as alive"
            time.sleep(0.01)
        probe.directory.writer.beat(0)
        assert not _node_alive(arena, object())
    finally:
        mine.close()
        arena.close()
        probe.close()
        store.tier.close()


def directory_fds() -> int:
    """Open fds of this process on a directory memfd (the node here holds its own two)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum("kvpool-directory" in name for name in names)


def test_a_client_from_before_the_directory_still_gets_the_arena_and_only_it() -> None:
    """The node sends the directory's two fds after the arena's; a client that takes one fd
    (every release before this one) gets the arena, and the kernel closes the rest."""
    node = Node()
    try:
        assert node.server.shm_address.startswith("shm://")
        old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old.settimeout(5)
        old.connect("\0" + node.server.shm_address[len("shm://") :])
        before = directory_fds()
        msg, fds, flags, _ = socket.recv_fds(old, PREAMBLE.size, 1)
        assert len(fds) == 1
        assert flags & socket.MSG_CTRUNC  # two more were offered
        assert PREAMBLE.unpack(msg)[0] == SHM_MAGIC
        assert os.fstat(fds[0]).st_size == node.tier.capacity_bytes  # the arena itself
        os.close(fds[0])
        assert directory_fds() == before  # the directory's were not installed here
        old.close()
        new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        new.settimeout(5)
        new.connect("\0" + node.server.shm_address[len("shm://") :])
        _msg, fds, _flags, _ = socket.recv_fds(new, PREAMBLE.size, 3)
        try:
            assert len(fds) == 3
            reader = DirectoryReader(fds[1], fds[2])
            assert reader.alive()
            reader.close()
        finally:
            for fd in fds:
                os.close(fd)
            new.close()
    finally:
        node.close()
