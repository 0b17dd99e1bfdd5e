"""Tensors as kvpool blocks: numpy arrays always, torch tensors and cupy arrays when installed.

    from kvpool.client.tensors import put_tensor, get_tensor, put_tensor_blocks, get_tensor_blocks

    put_tensor(kv, "weights/0", array)                    # one block: header + bytes
    get_tensor(kv, "weights/0")                           # the same shape and dtype, or None
    put_tensor_blocks(kv, keys, kv_cache, axis=3, block_len=64)   # one block per 64 rows
    read = get_tensor_blocks(kv, keys, like="torch")      # the leading run of hits, joined

A tensor split into blocks is cut along ``axis`` every ``block_len`` rows; every block is stored
padded to ``block_len`` rows (so all blocks of a tensor have one size), and the last block's
padding is dropped on read: the exact shape, dtype and length come back, never the padding.

Each block is self-describing: a 128-byte header (little-endian) then the padded rows,
C-contiguous, little-endian::

    offset  type      field
    0       4s        magic b"KVPT"
    4       u8        format version (1)
    5       u8        ndim (0..8)
    6       u8        axis the tensor was cut along
    7       u8        flags (0)
    8       16s       dtype name, NUL-padded (numpy's names, bfloat16, float8_e4m3fn, float8_e5m2)
    24      u64       valid: the real rows along axis in this block
    32      u64       start: this block's first row in the whole tensor
    40      u64       payload bytes after the header
    48      8 x u64   the padded block's shape (unused dimensions 0)
    112     16 bytes  reserved (0)

Reading checks the header against the block's size and the blocks against each other (same
dtype, shape and axis; each block starts where the previous one ended; only the last may be
partial): a block that does not fit is a miss, never data. The client has already checked every
block's checksum, so what is decoded is exactly what was put.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from kvpool.client.values import BytesLike
from kvpool.errors import InvalidArgumentError, InvalidValueError

if TYPE_CHECKING:
    import numpy.typing as npt

MAGIC = b"KVPT"
FORMAT_VERSION = 1
HEADER_BYTES = 128
MAX_NDIM = 8
_HEADER = struct.Struct("<4sBBBB16sQQQ8Q")
assert _HEADER.size <= HEADER_BYTES

LIKES = ("numpy", "torch", "cupy")
_NUMPY_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
_STORAGE: dict[str, str] = {"bfloat16": "<u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}
"""Dtypes numpy lacks (torch has them; numpy only with ml_dtypes): stored as raw integers."""


class BlockStore(Protocol):
    """What the helpers need of a client (``kvpool.Client`` has it)."""

    def put(self, key: str, value: BytesLike, *, strict: bool | None = None) -> bool: ...

    def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None: ...

    def batch_put(
        self, items: Mapping[str, BytesLike] | Sequence[tuple[str, BytesLike]]
    ) -> list[bool]: ...

    def batch_get(
        self, keys: Sequence[str], *, max_tier: str | None = None
    ) -> list[bytes | None]: ...


@dataclass(frozen=True, slots=True)
class BlockHeader:
    dtype: str
    shape: tuple[int, ...]
    """The padded block's shape."""
    axis: int
    valid: int
    start: int
    payload_bytes: int


class BlocksRead(NamedTuple):
    """What :func:`get_tensor_blocks` found: the leading run of blocks that were hits, joined
    (None when the first block missed), and how many blocks that is."""

    tensor: Any
    blocks: int


class BlockFormatError(InvalidValueError):
    """A block's bytes are not a tensor block this version understands (a miss for readers)."""

    code = "BLOCK_FORMAT"


# --- tensors <-> numpy ----------------------------------------------------------------------------


def _contiguous(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr`` C-contiguous, keeping a 0-d array 0-d (numpy.ascontiguousarray would not)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _module_of(value: object) -> str:
    return type(value).__module__.split(".", 1)[0]


def to_numpy(tensor: object) -> tuple[npt.NDArray[Any], str]:
    """A C-contiguous, little-endian numpy view (or copy) of ``tensor`` and its dtype name.

    torch tensors are detached and brought to the CPU; cupy arrays are copied to the host.
    Dtypes numpy lacks (bfloat16, float8) come back as their raw integer storage."""
    module = _module_of(tensor)
    if module == "torch":
        import torch

        assert isinstance(tensor, torch.Tensor)
        t = tensor.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name in _STORAGE:
            arr = t.view(torch.uint16 if _STORAGE[name] == "<u2" else torch.uint8).numpy()
            return _contiguous(arr), name
        if name not in _NUMPY_DTYPES:
            raise InvalidValueError(f"torch dtype {t.dtype} is not supported in tensor blocks")
        return _contiguous(t.numpy()), name
    if module == "cupy":
        arr = tensor.get()  # type: ignore[attr-defined]
        return to_numpy(arr)
    if isinstance(tensor, np.generic):  # a numpy scalar: a 0-d array
        tensor = np.asarray(tensor)
    if not isinstance(tensor, np.ndarray):
        raise InvalidValueError(
            f"expected a numpy array, torch tensor or cupy array, not {type(tensor).__name__}"
        )
    name = tensor.dtype.name
    if name in _STORAGE:  # an ml_dtypes array
        return _contiguous(tensor).view(_STORAGE[name]), name
    if name not in _NUMPY_DTYPES:
        raise InvalidValueError(f"numpy dtype {tensor.dtype} is not supported in tensor blocks")
    arr = tensor.astype(tensor.dtype.newbyteorder("<"), copy=False)
    return _contiguous(arr), name


def _storage_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(_STORAGE.get(name, name)).newbyteorder("<")


def from_numpy(arr: npt.NDArray[Any], dtype: str, like: str = "numpy", device: Any = None) -> Any:
    """``arr`` (raw storage for bfloat16/float8) as a ``like`` tensor of dtype ``dtype``."""
    if like == "torch":
        import torch

        arr = _contiguous(arr)
        t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if dtype in _STORAGE:
            t = t.view(getattr(torch, dtype))
        return t if device is None else t.to(device)
    if like == "cupy":
        import cupy

        return cupy.asarray(from_numpy(arr, dtype, "numpy"))
    if like != "numpy":
        raise InvalidArgumentError(f"like: expected one of {', '.join(LIKES)}, got {like!r}")
    if dtype in _STORAGE:
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidArgumentError(
                f"a {dtype} tensor needs like='torch' (numpy has no {dtype} without ml_dtypes)"
            ) from None
        return arr.view(getattr(ml_dtypes, dtype))
    return arr


# --- blocks ---------------------------------------------------------------------------------------


def block_count(length: int, block_len: int) -> int:
    """How many blocks a tensor of ``length`` rows along its axis makes."""
    return max(1, math.ceil(length / block_len))


def _encode(
    arr: npt.NDArray[Any],
    dtype: str,
    *,
    axis: int,
    start: int,
    valid: int,
    block_len: int,
    label: int | None = None,
) -> bytearray:
    """One block: the header and ``arr[start:start+valid]`` along ``axis``, padded to
    ``block_len`` rows with zeros; the header says it starts at row ``label`` (default
    ``start``)."""
    shape = list(arr.shape)
    if arr.ndim:
        shape[axis] = block_len
    payload = math.prod(shape) * arr.itemsize
    out = bytearray(HEADER_BYTES + payload)
    dims = [*shape, *[0] * (MAX_NDIM - len(shape))]
    _HEADER.pack_into(
        out,
        0,
        MAGIC,
        FORMAT_VERSION,
        arr.ndim,
        axis,
        0,
        dtype.encode("ascii"),
        valid,
        start if label is None else label,
        payload,
        *dims,
    )
    dst = np.frombuffer(out, dtype=arr.dtype, offset=HEADER_BYTES).reshape(shape)
    if arr.ndim == 0:
        dst[...] = arr
    else:
        index = [slice(None)] * arr.ndim
        index[axis] = slice(0, valid)
        source = [slice(None)] * arr.ndim
        source[axis] = slice(start, start + valid)
        dst[tuple(index)] = arr[tuple(source)]
    return out


def encode_tensor(tensor: object) -> bytearray:
    """One block holding a whole tensor (its shape, dtype and bytes)."""
    arr, dtype = to_numpy(tensor)
    rows = arr.shape[0] if arr.ndim else 0
    return _encode(arr, dtype, axis=0, start=0, valid=rows, block_len=rows)


def split_tensor(
    tensor: object, *, axis: int, block_len: int, start_row: int = 0
) -> list[bytearray]:
    """The blocks of ``tensor`` cut along ``axis`` every ``block_len`` rows; the last one padded.

    ``start_row``: where ``tensor`` starts in a larger tensor whose earlier blocks were stored
    before (a multiple of ``block_len``): the blocks are labelled with their rows in that one."""
    arr, dtype = to_numpy(tensor)
    if arr.ndim == 0:
        raise InvalidArgumentError("a 0-d tensor cannot be split into blocks")
    if arr.ndim > MAX_NDIM:
        raise InvalidArgumentError(f"tensors of more than {MAX_NDIM} dimensions are not supported")
    if not -arr.ndim <= axis < arr.ndim:
        raise InvalidArgumentError(f"axis {axis} is out of range for {arr.ndim} dimensions")
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
        raise InvalidArgumentError(f"block_len: expected a positive int, got {block_len!r}")
    if isinstance(start_row, bool) or not isinstance(start_row, int) or start_row < 0:
        raise InvalidArgumentError(f"start_row: expected an int >= 0, got {start_row!r}")
    if start_row % block_len:
        raise InvalidArgumentError(f"start_row {start_row} is not a multiple of {block_len}")
    axis %= arr.ndim
    length = arr.shape[axis]
    return [
        _encode(
            arr,
            dtype,
            axis=axis,
            start=i * block_len,
            label=start_row + i * block_len,
            valid=min(block_len, length - i * block_len),
            block_len=block_len,
        )
        for i in range(block_count(length, block_len))
    ]


def read_header(block: BytesLike) -> BlockHeader:
    """The header of a block; BlockFormatError when the bytes are not a valid tensor block."""
    view = memoryview(block).cast("B")  # type: ignore[arg-type]
    if view.nbytes < HEADER_BYTES:
        raise BlockFormatError(
            f"a tensor block is at least {HEADER_BYTES} bytes, got {view.nbytes}"
        )
    magic, version, ndim, axis, _flags, raw_dtype, valid, start, payload, *dims = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise BlockFormatError(f"not a tensor block (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise BlockFormatError(f"tensor block format {version}; this client reads {FORMAT_VERSION}")
    dtype = raw_dtype.rstrip(b"\0").decode("ascii", "replace")
    if dtype not in _NUMPY_DTYPES and dtype not in _STORAGE:
        raise BlockFormatError(f"unknown dtype {dtype!r} in a tensor block")
    if ndim > MAX_NDIM or (ndim and axis >= ndim) or any(dims[ndim:]):
        raise BlockFormatError(f"bad shape in a tensor block: ndim {ndim}, axis {axis}")
    shape = tuple(dims[:ndim])
    if payload != math.prod(shape) * _storage_dtype(dtype).itemsize:
        raise BlockFormatError(f"payload of {payload} bytes does not match shape {shape}")
    if view.nbytes != HEADER_BYTES + payload:
        raise BlockFormatError(
            f"block of {view.nbytes} bytes, header says {HEADER_BYTES + payload}"
        )
    if ndim and valid > shape[axis]:
        raise BlockFormatError(f"valid rows {valid} above the block's {shape[axis]}")
    return BlockHeader(dtype, shape, axis, valid, start, payload)


def decode_block(block: BytesLike) -> tuple[BlockHeader, npt.NDArray[Any]]:
    """The header and the block's real rows (padding dropped) as a numpy view of ``block``, in
    raw storage for bfloat16/float8 (see :func:`from_numpy`)."""
    header = read_header(block)
    arr = np.frombuffer(block, dtype=_storage_dtype(header.dtype), offset=HEADER_BYTES)
    arr = arr.reshape(header.shape)
    if arr.ndim:
        index = [slice(None)] * arr.ndim
        index[header.axis] = slice(0, header.valid)
        arr = arr[tuple(index)]
    return header, arr


def decode_tensor(block: BytesLike, *, like: str = "numpy", device: Any = None) -> Any:
    """The tensor :func:`encode_tensor` stored (as numpy: a view of ``block``, read-only when
    ``block`` is bytes)."""
    header, arr = decode_block(block)
    return from_numpy(arr, header.dtype, like, device)


def _follows(i: int, header: BlockHeader, first: BlockHeader, expected_start: int) -> str:
    """Why block ``i`` cannot follow the blocks before it ('' when it can)."""
    if (header.dtype, header.shape, header.axis) != (first.dtype, first.shape, first.axis):
        return f"block {i} is of another tensor (dtype, shape or axis)"
    if header.start != expected_start:
        return f"block {i} starts at row {header.start}, not {expected_start}"
    return ""


def _is_full(header: BlockHeader) -> bool:
    return not header.shape or header.valid == header.shape[header.axis]


def join_blocks(blocks: Sequence[BytesLike], *, like: str = "numpy", device: Any = None) -> Any:
    """The tensor whose leading blocks these are, joined along their axis (a new array).
    BlockFormatError when a block is malformed or the blocks do not follow each other."""
    if not blocks:
        raise InvalidArgumentError("join_blocks needs at least one block")
    decoded = [decode_block(b) for b in blocks]
    first = decoded[0][0]
    expected_start = 0
    for i, (header, _) in enumerate(decoded):
        problem = _follows(i, header, first, expected_start)
        if not problem and i < len(decoded) - 1 and not _is_full(header):
            problem = f"block {i} is partial but not the last"
        if problem:
            raise BlockFormatError(problem)
        expected_start += header.valid
    parts = [arr for _, arr in decoded]
    joined = parts[0].copy() if len(parts) == 1 else np.concatenate(parts, axis=first.axis)
    return from_numpy(joined, first.dtype, like, device)


def leading_blocks(blocks: Sequence[BytesLike | None]) -> int:
    """How many leading blocks are present, well formed and follow each other (what
    :func:`join_blocks` would accept)."""
    first: BlockHeader | None = None
    expected_start = 0
    for i, block in enumerate(blocks):
        if block is None:
            return i
        try:
            header = read_header(block)
        except BlockFormatError:
            return i
        first = first or header
        if _follows(i, header, first, expected_start):
            return i
        expected_start += header.valid
        if not _is_full(header):
            return i + 1  # a partial block ends the tensor
    return len(blocks)


# --- on a client ----------------------------------------------------------------------------------


def put_tensor(client: BlockStore, key: str, tensor: object) -> bool:
    """Store ``tensor`` (shape, dtype and bytes) as one block; True once committed."""
    return client.put(key, encode_tensor(tensor))


def get_tensor(
    client: BlockStore,
    key: str,
    *,
    like: str = "numpy",
    device: Any = None,
    max_tier: str | None = None,
) -> Any:
    """The tensor stored under ``key`` as ``like`` (numpy, torch or cupy), or None on a miss
    (a block that is not a tensor block is a miss too)."""
    if like not in LIKES:
        raise InvalidArgumentError(f"like: expected one of {', '.join(LIKES)}, got {like!r}")
    data = client.get(key, max_tier=max_tier)
    if data is None:
        return None
    try:
        return decode_tensor(data, like=like, device=device)
    except BlockFormatError:
        return None


def put_tensor_blocks(
    client: BlockStore,
    keys: Sequence[str],
    tensor: object,
    *,
    axis: int,
    block_len: int,
    start_row: int = 0,
) -> list[bool]:
    """Store ``tensor`` cut along ``axis`` into blocks of ``block_len`` rows, block ``i`` under
    ``keys[i]`` (one batched commit); one bool per block. ``keys`` must name every block.
    ``start_row``: ``tensor`` continues a larger one whose blocks before that row were stored
    earlier (see :func:`split_tensor`)."""
    blocks = split_tensor(tensor, axis=axis, block_len=block_len, start_row=start_row)
    if len(keys) != len(blocks):
        raise InvalidArgumentError(f"{len(blocks)} blocks need {len(blocks)} keys, got {len(keys)}")
    return client.batch_put(list(zip(keys, blocks, strict=True)))


def get_tensor_blocks(
    client: BlockStore,
    keys: Sequence[str],
    *,
    like: str = "numpy",
    device: Any = None,
    max_tier: str | None = None,
) -> BlocksRead:
    """Read the blocks under ``keys`` (one batched get) and join the leading run of hits: the
    whole tensor when every block is there, a prefix of it along its axis otherwise."""
    if like not in LIKES:
        raise InvalidArgumentError(f"like: expected one of {', '.join(LIKES)}, got {like!r}")
    if not keys:
        return BlocksRead(None, 0)
    found = client.batch_get(keys, max_tier=max_tier)
    n = leading_blocks(found)
    if n == 0:
        return BlocksRead(None, 0)
    run = [b for b in found[:n] if b is not None]
    return BlocksRead(join_blocks(run, like=like, device=device), n)
