"""A same-host client's view of a node's shared directory, for the block-table tests and their
state machines (:mod:`kvpool.transports.directory`)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.checksum import block_checksum
from kvpool.proto.wire import TierLevel
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.shm_server import Directory
from kvpool.transports.directory import DirectoryReader


class Probe:
    """A same-host client's view of a node's directory: reads it as a client does (copy, then
    check the copy against the listed checksum) and checks the listing against the table."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.directory = Directory(store)
        writer = self.directory.writer
        self.reader = DirectoryReader(writer.fd, writer.hits_fd)

    def read(self, key: str) -> tuple[int, bytes] | None:
        """(write id, bytes) of a read through the directory that checks; None otherwise."""
        found = self.reader.find(key.encode())
        if found is None:
            return None
        data = bytes(self.store.tier.view(found.offset, found.size))
        if block_checksum(data) != found.checksum:
            return None  # its memory was reused: the client reads through the node
        self.reader.count_read(found.slot)
        return found.write_id, data

    def read_checked(self, key: str, written: Callable[[str, int, int], bytes]) -> bool:
        """A read through the directory, if it checks, is the exact bytes ``written(key, write
        id, size)`` gives: a committed write's, never another's. Whether it read."""
        got = self.read(key)
        if got is None:
            return False
        write_id, data = got
        assert data == written(key, write_id, len(data)), "read another write's bytes"
        return True

    def check(self) -> None:
        """Listed: exactly the committed blocks with a ready CPU copy, each where it lies."""
        expected = {
            b.id: b
            for b in self.store.committed_blocks()
            if (cpu := b.copies.get(TierLevel.CPU)) is not None and cpu.ready
        }
        listed = {b.id for b in self.directory._at.values()}
        assert listed == set(expected) or self.directory.full, (listed, set(expected))
        for block_id in listed:
            block = expected[block_id]
            found = self.reader.find(block.key.encode())
            assert found is not None
            assert (found.offset, found.size, found.checksum, found.write_id) == (
                block.offset,
                block.size_bytes,
                block.checksum,
                block.write_id,
            )

    def close(self) -> None:
        self.reader.close()
        self.directory.close()
