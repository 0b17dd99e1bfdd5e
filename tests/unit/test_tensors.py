"""Tensor helpers (kvpool.client.tensors): exact shape, dtype and length back; padding never
returned as data; blocks that do not belong are misses."""

from __future__ import annotations

import importlib.util
import struct
from typing import Any

import numpy as np
import pytest

from kvpool.client import tensors
from kvpool.client.tensors import (
    HEADER_BYTES,
    BlockFormatError,
    decode_tensor,
    encode_tensor,
    get_tensor,
    get_tensor_blocks,
    join_blocks,
    leading_blocks,
    put_tensor,
    put_tensor_blocks,
    split_tensor,
)
from kvpool.errors import InvalidArgumentError, InvalidValueError
from tests.unit.memstore import MemoryStore

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="torch is not installed (pip install kvpool[llm])"
)

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "float32",
          "float64", "complex64"]  # fmt: skip


def _array(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_tensor_round_trip(dtype: str) -> None:
    arr = _array((3, 5, 7), dtype)
    back = decode_tensor(encode_tensor(arr))
    assert back.dtype == arr.dtype
    assert back.shape == arr.shape
    assert np.array_equal(back, arr)


@pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (1,), (2, 3, 4, 5, 6, 7, 8, 9)])
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    arr = _array(shape, "float32")
    back = decode_tensor(encode_tensor(arr))
    assert back.shape == arr.shape
    assert np.array_equal(back, arr)


def test_non_contiguous_and_big_endian_inputs() -> None:
    arr = _array((6, 8), "float64")
    sliced = arr[:, ::2]
    assert np.array_equal(decode_tensor(encode_tensor(sliced)), sliced)
    big = arr.astype(">f8")
    back = decode_tensor(encode_tensor(big))
    assert back.dtype == np.dtype("<f8")
    assert np.array_equal(back, arr)


@pytest.mark.parametrize(("length", "block_len"), [(10, 4), (8, 4), (3, 4), (1, 1), (0, 4)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_split_pads_the_last_block_and_join_drops_the_padding(
    length: int, block_len: int, axis: int
) -> None:
    shape = [2, 3, 5]
    shape[axis] = length
    arr = _array(tuple(shape), "float32") + 1.0  # no zeros, so padding would show
    blocks = split_tensor(arr, axis=axis, block_len=block_len)
    assert len(blocks) == max(1, -(-length // block_len))
    assert len({len(b) for b in blocks}) == 1  # every block padded to one size
    back = join_blocks(blocks)
    assert back.shape == arr.shape
    assert np.array_equal(back, arr)
    # Any leading run of blocks is the tensor's prefix along the axis.
    first = join_blocks(blocks[:1])
    assert first.shape[axis] == min(block_len, length)


def test_padding_is_zero_and_not_returned() -> None:
    arr = np.arange(1, 11, dtype=np.int32).reshape(10, 1)
    blocks = split_tensor(arr, axis=0, block_len=4)
    last = np.frombuffer(blocks[-1], dtype=np.int32, offset=HEADER_BYTES)
    assert list(last) == [9, 10, 0, 0]
    assert decode_tensor(blocks[-1]).ravel().tolist() == [9, 10]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "at least"),
        (lambda b: b"XXXX" + b[4:], "not a tensor block"),
        (lambda b: b[:4] + b"\x09" + b[5:], "format 9"),
        (lambda b: b + b"\0", "header says"),
        (lambda b: b[:8] + b"float128".ljust(16, b"\0") + b[24:], "unknown dtype"),
        (lambda b: b[:24] + struct.pack("<Q", 99) + b[32:], "valid rows"),
    ],
)
def test_malformed_blocks_are_refused(mutate: Any, message: str) -> None:
    block = bytes(split_tensor(np.ones((4, 2), np.float32), axis=0, block_len=4)[0])
    with pytest.raises(BlockFormatError, match=message):
        decode_tensor(mutate(block))


def test_blocks_that_do_not_follow_each_other_are_refused() -> None:
    a = split_tensor(_array((8, 2), "float32"), axis=0, block_len=4)
    b = split_tensor(_array((8, 3), "float32"), axis=0, block_len=4)
    with pytest.raises(BlockFormatError, match="another tensor"):
        join_blocks([a[0], b[1]])
    with pytest.raises(BlockFormatError, match="starts at row 4"):
        join_blocks([a[1], a[0]])
    c = split_tensor(_array((6, 2), "float32"), axis=0, block_len=4)
    with pytest.raises(BlockFormatError, match="starts at row"):
        join_blocks([c[1], c[1]])
    assert leading_blocks([a[0], a[1], b[0]]) == 2
    assert leading_blocks([a[0], None, a[1]]) == 1
    assert leading_blocks([b"junk"]) == 0


def test_bad_arguments_raise() -> None:
    arr = np.ones((4, 4), np.float32)
    with pytest.raises(InvalidArgumentError, match="axis"):
        split_tensor(arr, axis=2, block_len=2)
    with pytest.raises(InvalidArgumentError, match="block_len"):
        split_tensor(arr, axis=0, block_len=0)
    with pytest.raises(InvalidArgumentError, match="0-d"):
        split_tensor(np.float32(1.0), axis=0, block_len=1)
    with pytest.raises(InvalidValueError, match="object"):
        encode_tensor(np.array([object()]))
    with pytest.raises(InvalidValueError, match="numpy array"):
        encode_tensor([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="like"):
        get_tensor(MemoryStore(), "k", like="jax")


def test_on_a_store_whole_tensors_and_misses() -> None:
    store = MemoryStore()
    arr = _array((5, 6), "float16")
    assert put_tensor(store, "t", arr)
    back = get_tensor(store, "t")
    assert back.dtype == np.float16
    assert np.array_equal(back, arr)
    assert get_tensor(store, "absent") is None
    store.put("raw", b"not a tensor")
    assert get_tensor(store, "raw") is None  # foreign bytes are a miss, not data


def test_on_a_store_blocks_leading_run_of_hits() -> None:
    store = MemoryStore()
    arr = _array((2, 3, 37, 4), "float32")
    keys = [f"b{i}" for i in range(5)]
    assert put_tensor_blocks(store, keys, arr, axis=2, block_len=8) == [True] * 5
    read = get_tensor_blocks(store, keys)
    assert read.blocks == 5
    assert np.array_equal(read.tensor, arr)
    del store.blocks["b3"]
    read = get_tensor_blocks(store, keys)
    assert read.blocks == 3
    assert np.array_equal(read.tensor, arr[:, :, :24])
    store.blocks["b0"] = b"junk"
    assert get_tensor_blocks(store, keys) == (None, 0)
    with pytest.raises(InvalidArgumentError, match="5 blocks need 5 keys"):
        put_tensor_blocks(store, keys[:4], arr, axis=2, block_len=8)


def test_max_tier_is_passed_down() -> None:
    store = MemoryStore()
    arr = _array((8, 2), "float32")
    put_tensor_blocks(store, ["a", "b"], arr, axis=0, block_len=4)
    store.tier["b"] = "ssd"
    read = get_tensor_blocks(store, ["a", "b"], max_tier="cpu")
    assert read.blocks == 1
    assert store.misses["slow_tier"] == 1


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool"])
def test_torch_round_trip(dtype: str) -> None:
    import torch

    t = (torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(1)) * 10).to(
        getattr(torch, dtype)
    )
    back = decode_tensor(encode_tensor(t), like="torch")
    assert back.dtype == t.dtype
    assert torch.equal(back, t)
    blocks = split_tensor(t, axis=2, block_len=4)
    joined = join_blocks(blocks, like="torch")
    assert joined.dtype == t.dtype
    assert torch.equal(joined, t)


@needs_torch
def test_bfloat16_as_numpy_needs_ml_dtypes_or_torch() -> None:
    import torch

    block = encode_tensor(torch.ones(2, dtype=torch.bfloat16))
    if importlib.util.find_spec("ml_dtypes") is None:
        with pytest.raises(InvalidArgumentError, match="like='torch'"):
            decode_tensor(block)
    else:
        assert decode_tensor(block).dtype.name == "bfloat16"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
def test_cupy_round_trip() -> None:  # pragma: no cover - needs a GPU machine
    import cupy

    x = cupy.arange(24, dtype=cupy.float32).reshape(2, 12)
    back = join_blocks(split_tensor(x, axis=1, block_len=5), like="cupy")
    assert isinstance(back, cupy.ndarray)
    assert bool((back == x).all())


def test_format_constants_are_the_documented_ones() -> None:
    assert tensors.MAGIC == b"KVPT"
    assert tensors.HEADER_BYTES == 128
    assert tensors._HEADER.size == 112


def test_a_tensor_stored_in_two_parts_joins_as_one() -> None:
    store = MemoryStore()
    arr = _array((3, 20), "float32")
    keys = [f"k{i}" for i in range(5)]
    put_tensor_blocks(store, keys[:2], arr[:, :8], axis=1, block_len=4)
    put_tensor_blocks(store, keys[2:], arr[:, 8:], axis=1, block_len=4, start_row=8)
    read = get_tensor_blocks(store, keys)
    assert read.blocks == 5
    assert np.array_equal(read.tensor, arr)
    # The second part alone labelled from row 0 would not follow the first: a miss from there.
    put_tensor_blocks(store, keys[2:], arr[:, 8:], axis=1, block_len=4)
    assert get_tensor_blocks(store, keys).blocks == 2
    with pytest.raises(InvalidArgumentError, match="multiple of 4"):
        split_tensor(arr, axis=1, block_len=4, start_row=6)
