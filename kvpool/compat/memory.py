"""Raw addresses handed to the Mooncake API: which may be touched, and views over them.

Mooncake's zero-copy calls take integer addresses. Touching an address that is not host memory
of this process crashes the engine (a bad pointer) or reads device memory as if it were host
memory (a CUDA device pointer under unified addressing). So an address range is used only when
it lies inside a buffer given to ``register_buffer``, and ``register_buffer`` accepts a range
only when

* the process maps every page of it readable and writable, and not from a device file
  (``/proc/self/maps``: ``/dev/nvidia*``, ``/dev/dri/*``, ``/dev/kfd`` are GPU apertures), and
* where the CUDA driver is loaded in this process, the driver does not call it device or managed
  memory (``cuPointerGetAttribute``; pinned host memory is host memory).

Pure checks over injected readers, so that tests give them fixed inputs.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

DEVICE_FILE_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd", "/dev/accel")


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    writable: bool
    path: str


def parse_maps(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/<pid>/maps`` text, in address order."""
    out: list[Mapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        perms = parts[1]
        out.append(
            Mapping(
                int(lo, 16),
                int(hi, 16),
                perms[:2] == "rw",
                parts[5].strip() if len(parts) == 6 else "",
            )
        )
    return out


def host_range_problem(mappings: list[Mapping], start: int, size: int) -> str | None:
    """Why ``[start, start + size)`` is not writable host memory of the process, or None."""
    end = start + size
    at = start
    for m in mappings:
        if m.end <= at:
            continue
        if m.start > at:
            break
        if m.path.startswith(DEVICE_FILE_PREFIXES):
            return f"0x{at:x} is mapped from the device file {m.path} (device memory)"
        if not m.writable:
            return f"0x{at:x} is mapped read-only or inaccessible"
        at = m.end
        if at >= end:
            return None
    return f"0x{at:x} is not mapped in this process"


def _read_own_maps() -> str:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return f.read()


# cuPointerGetAttribute attributes and answers (cuda.h).
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
_CU_MEMORYTYPE_DEVICE = 2
_CU_MEMORYTYPE_ARRAY = 3


def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, only if this process has loaded it already (an engine with
    CUDA tensors has); never loaded here, so a CPU process stays free of it."""
    if sys.platform != "linux":
        return None
    try:
        maps = _read_own_maps()
    except OSError:
        return None
    if "libcuda.so" not in maps:
        return None
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_device_problem(ptr: int, driver: ctypes.CDLL | None) -> str | None:
    """Why the CUDA driver says ``ptr`` is not host memory, or None (host, or no driver)."""
    if driver is None:
        return None
    value = ctypes.c_uint(0)
    memory_type = driver.cuPointerGetAttribute(
        ctypes.byref(value), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(ptr)
    )
    if memory_type == 0 and value.value in (_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_ARRAY):
        return f"0x{ptr:x} is CUDA device memory"
    managed = ctypes.c_uint(0)
    rc = driver.cuPointerGetAttribute(
        ctypes.byref(managed), _CU_POINTER_ATTRIBUTE_IS_MANAGED, ctypes.c_uint64(ptr)
    )
    if rc == 0 and managed.value:
        return f"0x{ptr:x} is CUDA managed memory"
    return None  # an error answer: memory the driver does not know, i.e. plain host memory


def is_address(value: object) -> bool:
    """Callers pass addresses from ctypes, numpy or torch: refuse anything else early."""
    return isinstance(value, int) and not isinstance(value, bool)


class Regions:
    """The address ranges registered with ``register_buffer``; views over ranges inside them."""

    def __init__(
        self,
        read_maps: Callable[[], str] = _read_own_maps,
        driver: Callable[[], ctypes.CDLL | None] = _cuda_driver,
    ) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}
        self._read_maps = read_maps
        self._driver = driver

    def register(self, ptr: object, size: object) -> str | None:
        """Record ``[ptr, ptr + size)``; why it was refused, or None."""
        if not is_address(ptr) or not is_address(size):
            return f"buffer_ptr and size must be integers, got {type(ptr).__name__}, {size!r}"
        assert isinstance(ptr, int)
        assert isinstance(size, int)
        if ptr <= 0 or size <= 0:
            return f"buffer_ptr 0x{max(ptr, 0):x} and size {size} must be positive"
        problem = cuda_device_problem(ptr, self._driver())
        if problem is None:
            try:
                problem = host_range_problem(parse_maps(self._read_maps()), ptr, size)
            except OSError as e:
                problem = f"cannot read this process's memory map: {e}"
        if problem is not None:
            return problem
        with self._lock:
            self._regions[ptr] = max(size, self._regions.get(ptr, 0))
        return None

    def unregister(self, ptr: object) -> bool:
        with self._lock:
            return self._regions.pop(ptr, None) is not None  # type: ignore[call-overload]

    def contains(self, ptr: int, size: int) -> bool:
        with self._lock:
            return any(
                start <= ptr and ptr + size <= start + length
                for start, length in self._regions.items()
            )

    def view(self, ptr: object, size: object) -> memoryview | None:
        """A writable view of ``size`` registered bytes at ``ptr``, or None when the range is
        not inside one registered buffer."""
        if not is_address(ptr) or not is_address(size):
            return None
        assert isinstance(ptr, int)
        assert isinstance(size, int)
        if size < 0 or not self.contains(ptr, size):
            return None
        if size == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")

    def views(self, ptrs: object, sizes: object) -> list[memoryview] | None:
        """Views of several ranges (one object's parts), or None when any is refused."""
        if not isinstance(ptrs, list | tuple) or not isinstance(sizes, list | tuple):
            return None
        if len(ptrs) != len(sizes) or not ptrs:
            return None
        out = []
        for ptr, size in zip(ptrs, sizes, strict=True):
            view = self.view(ptr, size)
            if view is None:
                return None
            out.append(view)
        return out


def adjacent(ptrs: list[int], sizes: list[int]) -> bool:
    """Whether the ranges follow each other in memory, so that one view covers them all."""
    return all(ptrs[i] + sizes[i] == ptrs[i + 1] for i in range(len(ptrs) - 1))
