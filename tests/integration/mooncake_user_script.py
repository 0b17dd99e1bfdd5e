"""A script as a Mooncake Store user writes it (after Mooncake's Python API docs), run by
tests/integration/test_mooncake_compat.py against kvpool's MooncakeDistributedStore and, where
the ``mooncake`` package is installed, against Mooncake Store itself.

    python mooncake_user_script.py kvpool|mooncake MASTER_ADDRESS
"""

from __future__ import annotations

import os
import sys

import numpy as np

IMPL, MASTER = sys.argv[1], sys.argv[2]
if IMPL == "mooncake":
    from mooncake.store import MooncakeDistributedStore
else:
    from kvpool.compat.mooncake import MooncakeDistributedStore


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


store = MooncakeDistributedStore()
rc = store.setup("localhost", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", MASTER)
check(rc == 0, f"setup returned {rc}")
p = f"script-{os.getpid()}"

# Simple put/get
check(store.put(f"{p}/hello", b"Hello, Mooncake Store!") == 0, "put")
check(store.get(f"{p}/hello") == b"Hello, Mooncake Store!", "get")
check(store.get(f"{p}/missing") == b"", "get of a missing key is empty bytes")
check(store.is_exist(f"{p}/hello") == 1, "is_exist of a stored key")
check(store.is_exist(f"{p}/missing") == 0, "is_exist of a missing key")
check(store.batch_is_exist([f"{p}/hello", f"{p}/missing"]) == [1, 0], "batch_is_exist")
check(store.get_size(f"{p}/hello") == 22, "get_size")
check(store.get_size(f"{p}/missing") < 0, "get_size of a missing key is negative")

# NumPy arrays as bytes
weights = np.random.default_rng(0).standard_normal((100, 100)).astype(np.float32)
check(store.put(f"{p}/weights", weights.tobytes()) == 0, "put weights")
back = np.frombuffer(store.get(f"{p}/weights"), dtype=np.float32).reshape(100, 100)
check(np.array_equal(back, weights), "weights round trip")

# Batches
keys = [f"{p}/key{i}" for i in range(3)]
values = [b"value1", b"value2", b"value3"]
check(store.put_batch(keys, values) == 0, "put_batch")
check(store.get_batch(keys) == values, "get_batch")

# Zero copy, on registered buffers
src = np.random.default_rng(1).integers(0, 255, size=1 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
src_ptr, dst_ptr = src.ctypes.data, dst.ctypes.data
check(store.register_buffer(src_ptr, src.nbytes) == 0, "register_buffer src")
check(store.register_buffer(dst_ptr, dst.nbytes) == 0, "register_buffer dst")
check(store.put_from(f"{p}/large", src_ptr, src.nbytes) == 0, "put_from")
check(store.get_into(f"{p}/large", dst_ptr, dst.nbytes) == src.nbytes, "get_into bytes read")
check(np.array_equal(src, dst), "get_into content")
check(store.get_into(f"{p}/missing", dst_ptr, dst.nbytes) < 0, "get_into of a missing key")

n, size = 4, 256 * 1024
zkeys = [f"{p}/slice{i}" for i in range(n)]
check(
    store.batch_put_from(zkeys, [src_ptr + i * size for i in range(n)], [size] * n) == [0] * n,
    "batch_put_from",
)
dst[:] = 0
results = store.batch_get_into(zkeys, [dst_ptr + i * size for i in range(n)], [size] * n)
check(results == [size] * n, f"batch_get_into returned {results}")
check(np.array_equal(src, dst), "batch_get_into content")
check(store.unregister_buffer(src_ptr) == 0, "unregister_buffer src")
check(store.unregister_buffer(dst_ptr) == 0, "unregister_buffer dst")

# Removal (of keys not read: Mooncake keeps a read lease on the others for a few seconds)
check(store.put(f"{p}/scratch", b"x" * 100) == 0, "put scratch")
check(store.remove(f"{p}/scratch") == 0, "remove")
check(store.is_exist(f"{p}/scratch") == 0, "removed key is gone")
check(store.get(f"{p}/scratch") == b"", "removed key reads empty")
check(store.remove(f"{p}/scratch") < 0, "removing a missing key is an error")

# A put of an existing key keeps the first value; upsert replaces it
check(store.put(f"{p}/once", b"first") == 0, "put first")
check(store.put(f"{p}/once", b"second") == 0, "put of an existing key answers 0")
check(store.get(f"{p}/once") == b"first", "put of an existing key keeps the first value")
check(store.upsert(f"{p}/once", b"second") == 0, "upsert")
check(store.get(f"{p}/once") == b"second", "upsert replaces the value")

# Parts gathered into one object, read back into buffer handles
check(store.put_parts(f"{p}/parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0, "put_parts")
check(store.get(f"{p}/parts") == b"abcdef", "put_parts is one object")
handle = store.get_buffer(f"{p}/parts")
check(handle is not None and bytes(memoryview(handle)) == b"abcdef", "get_buffer content")
check(handle.size() == 6 and len(handle) == 6 and handle.ptr() != 0, "get_buffer handle")
check(store.get_buffer(f"{p}/missing") is None, "get_buffer of a missing key is None")
handles = store.batch_get_buffer([f"{p}/parts", f"{p}/missing", f"{p}/once"])
check(handles[1] is None, "batch_get_buffer misses are None")
check(bytes(memoryview(handles[0])) == b"abcdef", "batch_get_buffer first")
check(bytes(memoryview(handles[2])) == b"second", "batch_get_buffer third")

# An object spread over several buffers (not adjacent in memory)
page = 64 * 1024
pool = np.random.default_rng(2).integers(0, 255, size=8 * page, dtype=np.uint8)
back_pool = np.zeros_like(pool)
base, back_base = pool.ctypes.data, back_pool.ctypes.data
check(store.register_buffer(base, pool.nbytes) == 0, "register_buffer pool")
check(store.register_buffer(back_base, back_pool.nbytes) == 0, "register_buffer back pool")
mkeys = [f"{p}/multi{i}" for i in range(2)]
layout = [[0, 4], [2, 6]]  # object i = pages layout[i], in that order
put_codes = store.batch_put_from_multi_buffers(
    mkeys, [[base + j * page for j in pages] for pages in layout], [[page, page]] * 2
)
check(put_codes == [0, 0], f"batch_put_from_multi_buffers returned {put_codes}")
get_codes = store.batch_get_into_multi_buffers(
    mkeys, [[back_base + j * page for j in pages] for pages in layout], [[page, page]] * 2
)
check(get_codes == [2 * page] * 2, f"batch_get_into_multi_buffers returned {get_codes}")
for pages in layout:
    for j in pages:
        got = back_pool[j * page : (j + 1) * page]
        check(np.array_equal(got, pool[j * page : (j + 1) * page]), f"multi-buffer page {j}")
check(store.get(mkeys[0]) == pool[0:page].tobytes() + pool[4 * page : 5 * page].tobytes(),
      "a multi-buffer object reads as one object")  # fmt: skip
check(store.unregister_buffer(base) == 0, "unregister pool")
check(store.unregister_buffer(back_base) == 0, "unregister back pool")

# Batch removal, health, removal of everything
check(store.put(f"{p}/gone", b"x") == 0, "put gone")
codes = store.batch_remove([f"{p}/gone", f"{p}/never"])
check(codes[0] == 0 and codes[1] < 0, f"batch_remove returned {codes}")
check(store.health_check() == 0, "health_check")
left = [f"{p}/hello", f"{p}/once", f"{p}/parts", *mkeys]
removed = store.remove_all(True)
check(removed >= len(left), f"remove_all removed {removed}")
check(store.batch_is_exist(left) == [0] * len(left), "nothing left after remove_all")

check(store.close() == 0, "close")
check(store.health_check() == 1, "health_check after close")
print("SCRIPT OK", flush=True)
