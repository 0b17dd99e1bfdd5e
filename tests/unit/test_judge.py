"""How the client judges one node's answer to a read (``kvpool.client.plans.judge``), pure.

A node is a peer like any other: its answer's header (write id, size, checksum) and its bytes
are checked against the index entry the read names. Whatever the node claims, a block that is
not the one the entry names is a miss with its reason, never a value (the first rule: a block
may be lost, it must never be read wrong).
"""

from __future__ import annotations

import pytest

from kvpool.checksum import block_checksum
from kvpool.client.plans import DirectEntry, Entry, ReadItem, judge
from kvpool.errors import BlockMissError, ChecksumMismatchError, TransportError, UnavailableError
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import MissReason, Status, TierLevel

BLOCK = b"the block's own bytes"
WRITE = 0x51
NODE = "tcp://n1:1"


def indexed() -> common_pb2.BlockEntry:
    """What the index holds for the key: the write, its size and its checksum."""
    return common_pb2.BlockEntry(
        key="k",
        found=True,
        write_id=WRITE,
        size_bytes=len(BLOCK),
        checksum=block_checksum(BLOCK),
        replicas=[1],
    )


def item(entry: Entry, sink: memoryview | None = None) -> ReadItem:
    return ReadItem("k", b"k", entry, sink=sink, caller_buffer=sink is not None, replicas=[1])


def answer(
    *,
    status: int = Status.OK,
    flags: int = TierLevel.CPU,
    write_id: int = WRITE,
    size: int = len(BLOCK),
    checksum: int | None = None,
) -> tuple[int, ...]:
    return (status, flags, write_id, size, block_checksum(BLOCK) if checksum is None else checksum)


def test_the_write_the_entry_names_with_its_bytes_is_a_hit() -> None:
    it = item(indexed())
    judge(it, NODE, answer(), memoryview(BLOCK))
    assert it.ok
    assert it.value == BLOCK
    assert it.tier == TierLevel.CPU
    assert not it.reasons


def test_a_hit_into_the_callers_buffer_fills_it() -> None:
    buffer = bytearray(len(BLOCK))
    it = item(indexed(), sink=memoryview(buffer))
    judge(it, NODE, answer(), memoryview(BLOCK))
    assert it.ok
    assert bytes(buffer) == BLOCK
    assert it.value is None


LIES = {
    "another write id": (
        answer(write_id=WRITE + 1),
        BLOCK,
        "version_mismatch",
        BlockMissError,
    ),
    "another size, bytes to match": (
        answer(size=len(BLOCK) - 1, checksum=block_checksum(BLOCK[:-1])),
        BLOCK[:-1],
        "checksum_mismatch",
        ChecksumMismatchError,
    ),
    "another checksum, bytes to match": (
        answer(checksum=block_checksum(b"other bytes!!!!!!!!!!"), size=21),
        b"other bytes!!!!!!!!!!",
        "checksum_mismatch",
        ChecksumMismatchError,
    ),
    "the right header over other bytes": (
        answer(),
        b"x" * len(BLOCK),
        "checksum_mismatch",
        ChecksumMismatchError,
    ),
    "the right header, the bytes cut short": (
        answer(),
        BLOCK[:-3],
        "node_down",
        UnavailableError,
    ),
    "the right header, no bytes": (answer(), None, "node_down", UnavailableError),
    "a miss it says was another version": (
        answer(status=Status.MISS, flags=MissReason.WRONG_VERSION),
        None,
        "version_mismatch",
        BlockMissError,
    ),
    "an error status": (answer(status=Status.INTERNAL), BLOCK, "node_error", TransportError),
}


@pytest.mark.parametrize("told", LIES.values(), ids=list(LIES))
@pytest.mark.parametrize("into", [False, True], ids=["bytes", "into"])
def test_an_answer_that_is_not_the_indexed_block_is_a_miss_never_a_value(
    told: tuple[tuple[int, ...], bytes | None, str, type[Exception]], into: bool
) -> None:
    header, data, reason, error = told
    buffer = bytearray(b"\0" * len(BLOCK))
    it = item(indexed(), sink=memoryview(buffer) if into else None)
    judge(it, NODE, header, None if data is None else memoryview(data))
    assert not it.ok
    assert it.value is None
    assert it.reason == reason
    assert isinstance(it.error(), error)
    assert bytes(buffer) == b"\0" * len(BLOCK)  # nothing was copied into the caller's buffer


def test_a_read_by_content_takes_the_nodes_write_and_fills_the_entry_in() -> None:
    entry = DirectEntry("k", [1])
    it = item(entry)
    judge(it, NODE, answer(), memoryview(BLOCK))
    assert it.ok
    assert it.value == BLOCK
    assert (entry.write_id, entry.size_bytes, entry.checksum) == (
        WRITE,
        len(BLOCK),
        block_checksum(BLOCK),
    )


@pytest.mark.parametrize(
    ("header", "data", "reason"),
    [
        (answer(write_id=0), BLOCK, "version_mismatch"),  # names no write
        (answer(checksum=block_checksum(b"x")), BLOCK, "checksum_mismatch"),
    ],
    ids=["no write id", "bytes that do not hash to the checksum named"],
)
def test_a_read_by_content_refuses_an_answer_that_does_not_check(
    header: tuple[int, ...], data: bytes, reason: str
) -> None:
    entry = DirectEntry("k", [1])
    it = item(entry)
    judge(it, NODE, header, memoryview(data))
    assert not it.ok
    assert it.value is None
    assert it.reason == reason
    assert (entry.write_id, entry.size_bytes, entry.checksum) == (0, 0, 0)  # nothing learned


def test_a_read_by_content_into_a_buffer_refuses_a_block_of_another_size() -> None:
    buffer = bytearray(len(BLOCK) + 1)
    entry = DirectEntry("k", [1])
    entry.size_bytes = len(buffer)  # the caller's buffer names the size
    it = item(entry, sink=memoryview(buffer))
    judge(it, NODE, answer(), memoryview(BLOCK))
    assert not it.ok
    assert it.reason == "version_mismatch"
    assert entry.write_id == 0
