"""What the client accepts as keys, values and read buffers — and that values are not copied."""

from __future__ import annotations

import array
import mmap
from typing import Any

import numpy as np
import pytest

from kvpool.client.values import (
    as_payload,
    as_sink,
    check_fits,
    put_items,
    validate_key,
    validate_key_names,
    validate_keys,
)
from kvpool.errors import (
    BufferTooSmallError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidValueError,
    ValueTooLargeError,
)
from kvpool.proto.wire import MAX_KEY_BYTES

LIMIT = 1 << 20

# --- keys -------------------------------------------------------------------------------------


def test_valid_keys_become_their_utf8_bytes() -> None:
    assert validate_key("a") == b"a"
    assert validate_key("mdl/\u00e9\u4e2d") == "mdl/\u00e9\u4e2d".encode()
    assert validate_key("k" * MAX_KEY_BYTES) == b"k" * MAX_KEY_BYTES
    assert validate_key("\u4e2d" * (MAX_KEY_BYTES // 3)) == "\u4e2d".encode() * 341


@pytest.mark.parametrize(
    "key",
    [
        "",
        "k" * (MAX_KEY_BYTES + 1),
        "\u00e9" * (MAX_KEY_BYTES // 2 + 1),  # few characters, too many UTF-8 bytes
        "\ud800",  # a lone surrogate cannot be encoded
        b"bytes",
        7,
        None,
        ("a",),
    ],
    ids=["empty", "long", "long-utf8", "surrogate", "bytes", "int", "none", "tuple"],
)
def test_bad_keys_raise_invalid_key(key: Any) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)
    with pytest.raises(InvalidKeyError):  # the names-only check refuses the same keys
        validate_key_names(["ok", key])


def test_key_names_pass_what_validate_key_passes() -> None:
    good = ["a", "mdl/\u00e9\u4e2d", "k" * MAX_KEY_BYTES, "\u4e2d" * (MAX_KEY_BYTES // 3)]
    assert validate_key_names(good) == good
    assert validate_key_names(tuple(good)) == good
    with pytest.raises(InvalidKeyError):
        validate_key_names("abc")


def test_key_errors_are_caller_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        validate_key("")
    with pytest.raises(ValueError, match="empty"):  # plain `except ValueError` works too
        validate_key("")


def test_validate_keys_needs_a_sequence_of_str() -> None:
    assert validate_keys(["a", "b"]) == [("a", b"a"), ("b", b"b")]
    assert validate_keys(()) == []
    with pytest.raises(InvalidKeyError):
        validate_keys("abc")  # a str is not a list of keys
    with pytest.raises(InvalidKeyError):
        validate_keys({"a", "b"})  # unordered: results could not be matched to keys
    with pytest.raises(InvalidKeyError):
        validate_keys(["a", ""])


# --- values -----------------------------------------------------------------------------------


def test_bytes_like_values_are_viewed_not_copied() -> None:
    ba = bytearray(b"abcd")
    view = as_payload(ba, LIMIT)
    ba[0] = ord("z")
    assert bytes(view) == b"zbcd"  # the view is over the caller's memory
    assert as_payload(b"xyz", LIMIT).obj == b"xyz"
    mv = memoryview(bytearray(16))
    assert as_payload(mv, LIMIT) is mv  # already flat bytes: used as is


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(10, dtype=np.uint8),
        np.arange(12, dtype=np.float16).reshape(3, 4),
        np.ones((2, 3, 4), dtype=np.float32),
        np.array([1 + 2j, 3j]),
        np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.zeros((0, 5), dtype=np.int64),
        np.arange(8, dtype=">i4"),
    ],
    ids=["u8", "f16-2d", "f32-3d", "complex", "datetime", "structured", "empty", "big-endian"],
)
def test_numpy_arrays_are_sent_as_their_raw_bytes(arr: np.ndarray) -> None:
    view = as_payload(arr, LIMIT)
    assert view.format == "B"
    assert view.ndim == 1
    assert view.nbytes == arr.nbytes
    assert bytes(view) == arr.tobytes()
    if arr.size:
        arr.reshape(-1).view(np.uint8)[0] ^= 0xFF  # still the array's own memory
        assert bytes(view) == arr.tobytes()


def test_multidimensional_memoryview_is_flattened() -> None:
    mv = np.arange(6, dtype=np.int32).reshape(2, 3).data
    view = as_payload(mv, LIMIT)
    assert view.nbytes == 24
    assert bytes(view) == mv.tobytes()


@pytest.mark.parametrize(
    "value",
    [
        "text",
        1,
        1.5,
        None,
        [1, 2],
        array.array("i", [1, 2]),  # buffer protocol, but not a supported value type
        memoryview(b"abcdef")[::2],
        np.arange(16).reshape(4, 4)[:, 0],
        np.arange(16).reshape(4, 4).T,
        np.array([object(), 1]),
    ],
    ids=[
        "str",
        "int",
        "float",
        "none",
        "list",
        "array.array",
        "strided-view",
        "strided-numpy",
        "fortran-order",
        "object-dtype",
    ],
)
def test_unsupported_values_raise_invalid_value(value: Any) -> None:
    with pytest.raises(InvalidValueError):
        as_payload(value, LIMIT)


def test_size_limit_is_inclusive() -> None:
    assert as_payload(b"x" * 100, 100).nbytes == 100
    with pytest.raises(ValueTooLargeError, match="101 bytes"):
        as_payload(b"x" * 101, 100)
    with pytest.raises(ValueTooLargeError):
        as_payload(np.zeros(26, dtype=np.float32), 100)  # 104 bytes


# --- read buffers -----------------------------------------------------------------------------


def test_writable_buffers_are_accepted_as_flat_views() -> None:
    ba = bytearray(10)
    sink = as_sink(ba)
    sink[0] = 7
    assert ba[0] == 7
    arr = np.zeros((4, 4), dtype=np.float32)
    sink = as_sink(arr)
    assert sink.nbytes == 64
    sink[:4] = np.float32(1.5).tobytes()
    assert arr[0, 0] == 1.5
    with mmap.mmap(-1, 4096) as m:
        view = as_sink(m)
        assert view.nbytes == 4096
        view.release()


@pytest.mark.parametrize(
    "buffer",
    [
        b"read-only bytes",
        memoryview(b"read-only"),
        np.zeros(4, dtype=np.uint8)[::2],
        "str",
        12,
    ],
    ids=["bytes", "readonly-view", "strided", "str", "int"],
)
def test_bad_buffers_raise_invalid_value(buffer: Any) -> None:
    with pytest.raises(InvalidValueError):
        as_sink(buffer)


def test_readonly_numpy_buffer_is_refused() -> None:
    arr = np.zeros(8, dtype=np.uint8)
    arr.setflags(write=False)
    with pytest.raises(InvalidValueError):
        as_sink(arr)


def test_check_fits() -> None:
    sink = memoryview(bytearray(10))
    check_fits(sink, 10, "k")
    check_fits(sink, 0, "k")
    with pytest.raises(BufferTooSmallError, match="11 bytes"):
        check_fits(sink, 11, "k")


# --- batch items ------------------------------------------------------------------------------


def test_put_items_accepts_mappings_and_pairs_in_order() -> None:
    assert put_items({"a": b"1", "b": b"2"}) == [("a", b"1"), ("b", b"2")]
    assert put_items([("a", b"1"), ["b", b"2"]]) == [("a", b"1"), ("b", b"2")]
    assert put_items([]) == []
    for bad in ("ab", b"ab", 3, [("a", b"1", "extra")], [b"ab"]):
        with pytest.raises(InvalidValueError):
            put_items(bad)
