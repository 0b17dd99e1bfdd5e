"""Checking what a caller hands the client: keys, values to put, buffers to read into.

Pure functions, no I/O. Every check raises the typed caller error (an
:class:`~kvpool.errors.InvalidArgumentError`), in every mode: bad input is a bug in the caller,
not a failure of the cache.

Values are never copied here: a value becomes a flat, read-only ``memoryview`` of format ``'B'``
over the caller's own memory (bytes, bytearray, memoryview, C-contiguous numpy array of any
dtype), which the transport writes to the socket as is.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from kvpool.buffers import Parts
from kvpool.errors import (
    BufferTooSmallError,
    InvalidKeyError,
    InvalidValueError,
    ValueTooLargeError,
)
from kvpool.proto.wire import MAX_KEY_BYTES

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    BytesLike: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[Any]
    # Any writable buffer-protocol object (mmap, ctypes arrays, …); writability is checked at
    # run time.
    WritableBuffer: TypeAlias = bytearray | memoryview | npt.NDArray[Any] | Buffer
else:
    BytesLike: TypeAlias = bytes | bytearray | memoryview | Any
    WritableBuffer: TypeAlias = bytearray | memoryview | Any

# A block given in pieces (a list or tuple of them; the block is their bytes joined).
Value: TypeAlias = "BytesLike | Sequence[BytesLike] | Parts"
Into: TypeAlias = "WritableBuffer | Sequence[WritableBuffer] | Parts"
PutItems: TypeAlias = Mapping[str, "Value"] | Sequence[tuple[str, "Value"]]


def validate_key(key: object) -> bytes:
    """The UTF-8 bytes of ``key``; InvalidKeyError unless a non-empty str of at most
    MAX_KEY_BYTES UTF-8 bytes."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"a key must be a str, not {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates
        raise InvalidKeyError(f"key {key[:64]!r} is not encodable as UTF-8: {e.reason}") from None
    if not raw:
        raise InvalidKeyError("a key must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"key of {len(raw)} UTF-8 bytes is above the limit of {MAX_KEY_BYTES} "
            f"(key starts {key[:32]!r})"
        )
    return raw


def validate_keys(keys: object) -> list[tuple[str, bytes]]:
    """Each key with its UTF-8 bytes; a str (not a sequence of keys) is refused."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidKeyError(f"expected a sequence of str keys, not {type(keys).__name__}")
    return [(k, validate_key(k)) for k in keys]


def validate_key_names(keys: object) -> list[str]:
    """The keys as a list, each checked as :func:`validate_key` checks it, for a call that
    sends names only (no UTF-8 bytes kept; an ASCII key is not encoded to learn its length)."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidKeyError(f"expected a sequence of str keys, not {type(keys).__name__}")
    names = list(keys)
    if not names:
        return names
    # The whole batch at once (each test one C-level pass); key by key only when one fails.
    # ASCII (checked on the keys joined, which only str keys can be): a key's length in
    # characters is its length in UTF-8 bytes.
    try:
        ascii_str = "".join(names).isascii()
    except TypeError:  # a key that is not a str
        ascii_str = False
    if not ascii_str or "" in names or max(map(len, names)) > MAX_KEY_BYTES:
        for key in names:
            validate_key(key)  # raises, or passes a str that is valid UTF-8 within the limit
    return names


def _numpy_module() -> Any:
    # Without numpy imported, nothing the caller holds can be a numpy array.
    return sys.modules.get("numpy")


def _is_ndarray(value: object) -> bool:
    np_mod = _numpy_module()
    return np_mod is not None and isinstance(value, np_mod.ndarray)


def _ndarray_bytes(arr: np.ndarray[Any, Any]) -> memoryview:
    if arr.dtype.hasobject:
        raise InvalidValueError(
            f"a numpy array of dtype {arr.dtype} holds Python objects, not raw bytes"
        )
    if not arr.flags.c_contiguous:
        raise InvalidValueError(
            "a numpy array value must be C-contiguous (use numpy.ascontiguousarray)"
        )
    try:
        return memoryview(cast(Any, arr)).cast("B")
    except (TypeError, ValueError, BufferError):
        # dtypes the buffer protocol cannot describe (datetime64, …): view the raw bytes.
        np_mod = _numpy_module()
        return memoryview(arr.reshape(-1).view(np_mod.uint8))


def as_value(value: object, max_value_size: int) -> memoryview | Parts:
    """What a put sends: :func:`as_payload` of one value, or of a list or tuple of them — the
    block is their bytes joined, sent from where they are (a :class:`~kvpool.buffers.Parts`;
    a single piece is sent as a plain view)."""
    if type(value) is Parts:  # made by kvpool's own adapters, of flat views already
        _check_size(value.nbytes, max_value_size)
        return value
    if not isinstance(value, list | tuple):
        return as_payload(value, max_value_size)
    parts = Parts([_flat_payload(v) for v in value])
    _check_size(parts.nbytes, max_value_size)
    if len(parts.views) <= 1:
        return parts.views[0] if parts.views else memoryview(b"")
    return parts


def as_payload(value: object, max_value_size: int) -> memoryview:
    """A flat ``'B'`` view of a value's bytes, no copy.

    Accepts bytes, bytearray, memoryview (C-contiguous) and numpy arrays (C-contiguous, any
    non-object dtype). Anything else → InvalidValueError; more than ``max_value_size`` bytes →
    ValueTooLargeError.
    """
    view = _flat_payload(value)
    _check_size(view.nbytes, max_value_size)
    return view


def _check_size(nbytes: int, max_value_size: int) -> None:
    if nbytes > max_value_size:
        raise ValueTooLargeError(
            f"value of {nbytes} bytes is above max_value_size ({max_value_size} bytes)"
        )


def _flat_payload(value: object) -> memoryview:
    if isinstance(value, bytes | bytearray):
        view = memoryview(value)
    elif isinstance(value, memoryview):
        if not value.c_contiguous:
            raise InvalidValueError("a memoryview value must be C-contiguous")
        try:
            view = value.cast("B") if value.format != "B" or value.ndim != 1 else value
        except (TypeError, ValueError) as e:
            raise InvalidValueError(f"cannot view this memoryview as bytes: {e}") from None
    elif _is_ndarray(value):
        view = _ndarray_bytes(value)  # type: ignore[arg-type]
    else:
        raise InvalidValueError(
            f"unsupported value type {type(value).__name__}: use bytes, bytearray, "
            "memoryview or a numpy array (or a list of them, joined)"
        )
    return view


def as_into(buffer: object) -> memoryview | Parts:
    """Where a get_into reads: :func:`as_sink` of one buffer, or of a list or tuple of them,
    filled in order (a :class:`~kvpool.buffers.Parts`: the block is scattered into them as it
    is received; a single piece is a plain view)."""
    if type(buffer) is Parts:  # made by kvpool's own adapters, of flat writable views already
        return buffer
    if not isinstance(buffer, list | tuple):
        return as_sink(buffer)
    parts = Parts([as_sink(b) for b in buffer])
    return parts.views[0] if len(parts.views) == 1 else parts


def as_sink(buffer: object) -> memoryview:
    """A flat, writable ``'B'`` view of a caller's buffer (for get_into), no copy.

    Any writable, C-contiguous object with the buffer protocol (bytearray, memoryview, numpy
    array, mmap, …). Read-only, non-contiguous or non-buffer objects → InvalidValueError.
    """
    if isinstance(buffer, bytes):
        raise InvalidValueError("get_into needs a writable buffer; bytes are read-only")
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidValueError(
            f"get_into needs a writable buffer (bytearray, memoryview, numpy array), "
            f"not {type(buffer).__name__}"
        ) from None
    except (ValueError, BufferError) as e:
        raise InvalidValueError(f"cannot use this object as a buffer: {e}") from None
    if view.readonly:
        raise InvalidValueError("get_into needs a writable buffer; this one is read-only")
    if not view.c_contiguous:
        raise InvalidValueError("get_into needs a C-contiguous buffer")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError) as e:
        raise InvalidValueError(f"cannot view this buffer as bytes: {e}") from None


def check_fits(sink: memoryview | Parts, size_bytes: int, key: str) -> None:
    """BufferTooSmallError unless ``sink`` can hold a block of ``size_bytes``."""
    if sink.nbytes < size_bytes:
        raise BufferTooSmallError(
            f"block {key[:64]!r} is {size_bytes} bytes; the buffer holds only {sink.nbytes}"
        )


def put_items(items: object) -> list[tuple[Any, object]]:
    """``batch_put``'s argument as a list of (key, value) pairs, in order."""
    if isinstance(items, Mapping):
        return list(items.items())
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidValueError(
            "batch_put takes a mapping of key to value or a sequence of (key, value) pairs"
        )
    out: list[tuple[Any, object]] = []
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidValueError("batch_put takes (key, value) pairs")
        out.append((item[0], item[1]))
    return out
