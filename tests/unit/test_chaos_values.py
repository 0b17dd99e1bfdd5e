"""Chaos values name their writer: any byte read traces to one put, and every damage is seen."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.chaos.values import (
    BAD_BYTES,
    BAD_MAGIC,
    HEADER_BYTES,
    TOO_SHORT,
    WRONG_KEY,
    WRONG_SIZE,
    Corruption,
    SizeDistribution,
    ValueId,
    computed_writer,
    decode_value,
    key_hash,
    make_value,
)

keys = st.text(min_size=1, max_size=40)
sizes = st.integers(min_value=HEADER_BYTES, max_value=4096)


@settings(max_examples=200, deadline=None)
@given(key=keys, writer=st.integers(-(2**31), 2**31 - 1), seq=st.integers(0, 2**64 - 1), size=sizes)
def test_a_value_decodes_to_its_writer_and_sequence(
    key: str, writer: int, seq: int, size: int
) -> None:
    value = make_value(key, writer, seq, size)
    assert len(value) == size
    assert decode_value(key, value) == ValueId(writer, seq)
    assert decode_value(key, memoryview(bytearray(value))) == ValueId(writer, seq)


def test_values_are_deterministic_and_differ_by_key_writer_and_sequence() -> None:
    a = make_value("k", 1, 7, 1000)
    assert a == make_value("k", 1, 7, 1000)
    assert a[HEADER_BYTES:] != make_value("k", 2, 7, 1000)[HEADER_BYTES:]
    assert a[HEADER_BYTES:] != make_value("k", 1, 8, 1000)[HEADER_BYTES:]
    assert a[HEADER_BYTES:] != make_value("other", 1, 7, 1000)[HEADER_BYTES:]


@settings(max_examples=200, deadline=None)
@given(a=keys, b=keys, size=sizes)
def test_another_keys_value_never_decodes_as_this_keys(a: str, b: str, size: int) -> None:
    if a == b:
        return
    decoded = decode_value(a, make_value(b, 3, 4, size))
    assert isinstance(decoded, Corruption)
    assert decoded.reason == WRONG_KEY
    assert decoded.key_hash == key_hash(b)
    assert decoded.claimed == ValueId(3, 4)


@pytest.mark.parametrize("n", [0, 1, HEADER_BYTES - 1])
def test_a_read_shorter_than_a_header_is_too_short(n: int) -> None:
    decoded = decode_value("k", make_value("k", 1, 1, 100)[:n])
    assert isinstance(decoded, Corruption)
    assert decoded.reason == TOO_SHORT


def test_truncated_and_extended_reads_are_wrong_size() -> None:
    value = make_value("k", 1, 1, 5000)
    for data in (value[:-1], value[: HEADER_BYTES + 10], value + b"\0"):
        decoded = decode_value("k", data)
        assert isinstance(decoded, Corruption)
        assert decoded.reason == WRONG_SIZE, decoded


def test_foreign_bytes_are_bad_magic() -> None:
    decoded = decode_value("k", bytes(64))
    assert isinstance(decoded, Corruption)
    assert decoded.reason == BAD_MAGIC
    assert decoded.claimed is None


@pytest.mark.parametrize("offset", [0, 4, 12, 16, 24, HEADER_BYTES, 777, 4095])
def test_every_flipped_byte_is_detected(offset: int) -> None:
    value = bytearray(make_value("k", 5, 9, 4096))
    value[offset] ^= 0x01
    decoded = decode_value("k", value)
    assert isinstance(decoded, Corruption), offset
    expected = {0: BAD_MAGIC, 4: WRONG_KEY, 24: WRONG_SIZE}.get(offset, BAD_BYTES)
    assert decoded.reason == expected


def test_a_flipped_fill_byte_names_its_offset() -> None:
    value = bytearray(make_value("k", 5, 9, 4096))
    value[1234] ^= 0x80
    decoded = decode_value("k", value)
    assert isinstance(decoded, Corruption)
    assert decoded.reason == BAD_BYTES
    assert "1 of 4096 bytes differ, offsets 1234..1234" in decoded.detail
    assert decoded.claimed == ValueId(5, 9)


def test_a_torn_value_mixing_two_writes_of_one_key_is_detected() -> None:
    first = make_value("k", 1, 1, 8192)
    second = make_value("k", 2, 1, 8192)
    for torn in (first[:4096] + second[4096:], second[:4096] + first[4096:]):
        decoded = decode_value("k", torn)
        assert isinstance(decoded, Corruption)
        assert decoded.reason == BAD_BYTES
        assert "offsets 4096.." in decoded.detail


def test_a_header_claiming_another_writer_is_detected() -> None:
    value = bytearray(make_value("k", 1, 1, 256))
    struct.pack_into("<i", value, 12, 2)  # the writer field
    decoded = decode_value("k", value)
    assert isinstance(decoded, Corruption)
    assert decoded.reason == BAD_BYTES
    assert decoded.claimed == ValueId(2, 1)


def test_make_value_refuses_sizes_it_cannot_encode() -> None:
    with pytest.raises(ValueError, match="bytes"):
        make_value("k", 1, 1, HEADER_BYTES - 1)
    with pytest.raises(ValueError, match="out of range"):
        make_value("k", 2**31, 1, 100)
    assert len(make_value("k", 1, 1, HEADER_BYTES)) == HEADER_BYTES


def test_computed_writers_are_negative_and_distinct_per_process() -> None:
    ids = {computed_writer(p) for p in range(100)}
    assert len(ids) == 100
    assert all(w < 0 for w in ids)
    assert ValueId(computed_writer(0), 1).computed
    assert not ValueId(0, 1).computed


def test_value_ids_round_trip_through_json() -> None:
    v = ValueId(-3, 2**63)
    assert ValueId.from_json(v.to_json()) == v
    with pytest.raises(ValueError, match="writer, seq"):
        ValueId.from_json([1])


def test_sizes_span_the_distribution_and_stay_in_bounds() -> None:
    dist = SizeDistribution(64, 1 << 20)
    rng = random.Random(5)
    drawn = sorted(dist.draw(rng) for _ in range(5000))
    assert drawn[0] >= 64
    assert drawn[-1] <= 1 << 20
    assert drawn[len(drawn) // 2] < 64 << 10  # log-uniform: mostly small
    assert drawn[-1] > 512 << 10  # and some large
    assert SizeDistribution(100, 100).draw(rng) == 100
    with pytest.raises(ValueError, match="value sizes"):
        SizeDistribution(10, 100)
    with pytest.raises(ValueError, match="value sizes"):
        SizeDistribution(200, 100)
