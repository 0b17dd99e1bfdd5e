"""The GPU tier: one cupy device allocation with an :class:`Allocator` over it.

cupy is optional (``pip install 'kvpool[gpu]'``). :func:`probe_gpu` says whether a tier can be
made here and, when not, why — the node then starts with CPU and SSD only and logs the reason.
Bytes move between host memory and the device with cupy copies (synchronous on the tier's
stream); the tier worker calls them from a worker thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.proto.wire import TierLevel
from kvpool.store_node.allocator import Allocator

GPU_ALIGNMENT_BYTES = 256
"""cudaMalloc's alignment: every block starts on a 256-byte boundary."""


class GpuUnavailableError(Exception):
    """No GPU tier here; the message says why (no cupy, no device, not enough memory)."""


def _cupy() -> Any:
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise GpuUnavailableError(f"cupy is not importable ({type(e).__name__}: {e})") from e
    return cupy


def probe_gpu(device: int = 0) -> str | None:
    """None when a GPU tier can be made on ``device``; otherwise the reason it cannot."""
    try:
        cupy = _cupy()
        count = int(cupy.cuda.runtime.getDeviceCount())
    except GpuUnavailableError as e:
        return str(e)
    except Exception as e:  # cupy raises its own CUDARuntimeError without a driver
        return f"no CUDA device ({type(e).__name__}: {e})"
    if device >= count:
        return f"CUDA device {device} requested, {count} present"
    return None


class GpuTier:
    """Device memory on one CUDA device, addressed by offset."""

    level = TierLevel.GPU

    def __init__(self, capacity_bytes: int, *, device: int = 0, name: str = "gpu") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"GPU tier capacity must be positive, not {capacity_bytes}")
        reason = probe_gpu(device)
        if reason is not None:
            raise GpuUnavailableError(reason)
        self._cupy = _cupy()
        self._name = name
        self.device = device
        self._allocator = Allocator(capacity_bytes, alignment_bytes=GPU_ALIGNMENT_BYTES)
        try:
            with self._cupy.cuda.Device(device):
                self._arena: Any = self._cupy.empty(self._allocator.capacity_bytes, np.uint8)
                props = self._cupy.cuda.runtime.getDeviceProperties(device)
        except Exception as e:  # out of device memory, device busy
            raise GpuUnavailableError(
                f"cannot allocate {capacity_bytes} bytes on CUDA device {device}: {e}"
            ) from e
        raw_name = props.get("name", b"?")
        self._device_name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def detail(self) -> str:
        return f"CUDA device {self.device} ({self._device_name})"

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    def footprint(self, size_bytes: int) -> int:
        return self._allocator.footprint(size_bytes)

    def alloc(self, size_bytes: int) -> int | None:
        return self._allocator.alloc(size_bytes)

    def free(self, offset: int) -> None:
        self._allocator.free(offset)

    def fragmentation(self) -> float:
        return self._allocator.fragmentation()

    def _check(self, offset: int, size: int) -> None:
        if self._arena is None:
            raise ValueError(f"{self._name} tier is closed")
        if offset < 0 or offset + size > self._allocator.capacity_bytes:
            raise ValueError(f"range [{offset}, {offset + size}) is outside the GPU arena")

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Device → host: ``len(dest)`` bytes at ``offset`` into ``dest``."""
        size = len(dest)
        self._check(offset, size)
        if not size:
            return
        host = np.frombuffer(dest, dtype=np.uint8)
        with self._cupy.cuda.Device(self.device):
            self._arena[offset : offset + size].get(out=host)

    def write_from(self, offset: int, src: memoryview) -> None:
        """Host → device: ``src`` at ``offset``."""
        size = len(src)
        self._check(offset, size)
        if not size:
            return
        with self._cupy.cuda.Device(self.device):
            self._arena[offset : offset + size].set(np.frombuffer(src, dtype=np.uint8))

    def close(self) -> bool:
        if self._arena is None:
            return True
        self._arena = None
        try:
            with self._cupy.cuda.Device(self.device):
                self._cupy.get_default_memory_pool().free_all_blocks()
        except Exception:  # noqa: S110 - closing at exit: the process is going anyway
            pass
        return True
