"""The GPU tier. Without cupy or a CUDA device the ``gpu`` tests skip with the reason, and the
node starts with CPU and SSD only; ``python -m kvpool.store_node.gpu_check`` runs the same
checks (and these tests) on a machine with a GPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.config import NodeConfig
from kvpool.store_node import gpu_check
from kvpool.store_node.server import _open_gpu
from kvpool.store_node.tiers.gpu import GpuTier, GpuUnavailableError, probe_gpu

NO_GPU = probe_gpu(0)
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU tier here: {NO_GPU}")


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = info


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present")
def test_without_a_gpu_the_node_goes_on_with_cpu_and_ssd_and_says_why() -> None:
    log = Log()
    assert _open_gpu(NodeConfig(gpu_cache_size=1 << 20), log) is None
    (event, fields) = log.events[0]
    assert event == "gpu_tier_unavailable"
    assert fields["reason"]
    assert fields["tiers"] == "cpu and ssd only"
    with pytest.raises(GpuUnavailableError):
        GpuTier(1 << 20)
    assert gpu_check.main(["--no-pytest"]) == 2  # nothing to check here: exit 2


@pytest.mark.gpu
@needs_gpu
def test_gpu_tier_round_trips_bytes_at_any_offset() -> None:
    assert "byte exact" in gpu_check.check_tier_roundtrip(0)


@pytest.mark.gpu
@needs_gpu
def test_hot_blocks_go_up_to_the_gpu_and_gpu_only_blocks_are_demoted_not_lost(
    tmp_path: Path,
) -> None:
    promotion, demotion = gpu_check.check_promotion_and_demotion(0, tmp_path)
    assert "byte exact" in promotion
    assert "none lost" in demotion


@pytest.mark.gpu
@needs_gpu
def test_gpu_resident_blocks_are_served_over_tcp(tmp_path: Path) -> None:
    assert "byte exact" in gpu_check.check_data_plane(0, tmp_path)


class _FakeDeviceArray(np.ndarray):
    """cupy.ndarray's copy API over host memory: ``get(out=)`` and ``set(arr)``."""

    def get(self, out: Any = None) -> Any:
        if out is None:
            return np.array(self)
        out[...] = self
        return out

    def set(self, arr: Any) -> None:
        assert arr.shape == self.shape
        assert arr.dtype == self.dtype
        self[...] = arr


def fake_cupy() -> types.ModuleType:
    """The slice of cupy the GPU tier uses, on host memory: the GPU code paths run here."""
    cupy = types.ModuleType("cupy")

    class Device:
        def __init__(self, device: int = 0) -> None:
            self.device = device

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    class Pool:
        def free_all_blocks(self) -> None:
            return None

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda device: {"name": b"host memory standing in for a GPU"},
        memGetInfo=lambda: (1 << 30, 1 << 30),
    )
    cupy.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)  # type: ignore[attr-defined]
    cupy.empty = lambda n, dtype: np.empty(n, dtype).view(_FakeDeviceArray)  # type: ignore[attr-defined]
    cupy.get_default_memory_pool = Pool  # type: ignore[attr-defined]
    return cupy


def test_the_gpu_check_script_passes_against_a_host_memory_stand_in_for_cupy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    assert gpu_check.main(["--no-pytest"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for name in ("probe", "tier_roundtrip", "promotion", "demotion", "data_plane"):
        assert f"ok   {name}" in out
