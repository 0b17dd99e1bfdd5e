"""kvpool.compat.memory: which raw addresses the Mooncake API may touch."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpool.compat.memory import (
    Regions,
    adjacent,
    cuda_device_problem,
    host_range_problem,
    parse_maps,
)

MAPS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
7f0000000000-7f0000010000 rw-p 00000000 00:00 0
7f0000010000-7f0000020000 rw-p 00000000 00:00 0
7f0000020000-7f0000030000 ---p 00000000 00:00 0
7f0000030000-7f0000040000 rw-s 00000000 00:05 123 /dev/nvidia-uvm
7f0000040000-7f0000050000 r--p 00000000 00:00 0
"""


def test_a_range_across_adjacent_writable_mappings_is_host_memory() -> None:
    maps = parse_maps(MAPS)
    assert host_range_problem(maps, 0x7F0000000000, 0x20000) is None
    assert host_range_problem(maps, 0x7F000000F000, 0x2000) is None


def test_unmapped_read_only_and_device_ranges_are_named() -> None:
    maps = parse_maps(MAPS)
    assert "not mapped" in str(host_range_problem(maps, 0x1000, 16))
    assert "read-only or inaccessible" in str(host_range_problem(maps, 0x7F0000018000, 0x10000))
    assert "/dev/nvidia-uvm" in str(host_range_problem(maps, 0x7F0000030000, 16))
    assert "read-only" in str(host_range_problem(maps, 0x7F0000040000, 16))
    assert "not mapped" in str(host_range_problem(maps, 0x7F0000050000, 0x10))
    assert "read-only" in str(host_range_problem(maps, 0x400000, 16))


class FakeDriver:
    """cuPointerGetAttribute as the CUDA driver answers it, for chosen pointers."""

    def __init__(self, kinds: dict[int, str]) -> None:
        self.kinds = kinds

    def cuPointerGetAttribute(self, out: Any, attribute: int, ptr: ctypes.c_uint64) -> int:
        kind = self.kinds.get(ptr.value)
        if kind is None:
            return 1  # CUDA_ERROR_INVALID_VALUE: memory the driver does not know
        value = {2: {"device": 2, "pinned": 1, "managed": 1}[kind], 8: int(kind == "managed")}
        out._obj.value = value[attribute]
        return 0


def test_the_cuda_driver_decides_device_and_managed_memory() -> None:
    driver: Any = FakeDriver({0x10: "device", 0x20: "pinned", 0x30: "managed"})
    assert "device memory" in str(cuda_device_problem(0x10, driver))
    assert cuda_device_problem(0x20, driver) is None  # pinned host memory is host memory
    assert "managed" in str(cuda_device_problem(0x30, driver))
    assert cuda_device_problem(0x40, driver) is None
    assert cuda_device_problem(0x10, None) is None


def test_regions_hand_out_views_only_inside_registered_host_memory() -> None:
    buf = np.arange(256, dtype=np.uint8)
    ptr = buf.ctypes.data
    regions = Regions()
    assert regions.view(ptr, 16) is None
    assert regions.register(ptr, 128) is None
    view = regions.view(ptr + 8, 8)
    assert view is not None
    assert bytes(view) == bytes(range(8, 16))
    view[0] = 200
    assert buf[8] == 200
    assert regions.view(ptr + 120, 16) is None  # runs past the region
    assert regions.views([ptr, ptr + 64], [8, 8]) is not None
    assert regions.views([ptr, ptr + 200], [8, 8]) is None
    assert regions.views([ptr], [8, 8]) is None
    assert "integers" in str(regions.register(float(ptr), 8))
    assert "positive" in str(regions.register(ptr, 0))
    assert regions.unregister(ptr)
    assert not regions.unregister(ptr)
    assert regions.view(ptr, 8) is None


def test_device_memory_is_refused_even_where_it_is_mapped() -> None:
    regions = Regions(read_maps=lambda: MAPS, driver=lambda: FakeDriver({0x7F0000000000: "device"}))  # type: ignore[arg-type, return-value]
    assert "device memory" in str(regions.register(0x7F0000000000, 4096))
    assert regions.register(0x7F0000001000, 4096) is None


def test_adjacent() -> None:
    assert adjacent([100, 110, 130], [10, 20, 5])
    assert not adjacent([100, 111], [10, 5])
    assert adjacent([100], [10])
