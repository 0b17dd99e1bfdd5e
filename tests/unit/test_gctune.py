"""The full-collection watcher: a slow full collection freezes what survived it, and later
full collections skip the frozen objects."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from kvpool import gctune


@pytest.fixture
def watcher() -> Iterator[list[tuple[float, int]]]:
    frozen: list[tuple[float, int]] = []
    gctune.uninstall()
    gctune.freeze_after_slow_collections(
        threshold_ms=1.0, on_freeze=lambda ms, n: frozen.append((ms, n))
    )
    try:
        yield frozen
    finally:
        gctune.uninstall()


def _full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1e3


def test_a_slow_full_collection_freezes_the_survivors(watcher: list[tuple[float, int]]) -> None:
    # Half a million live containers, like a node's block table: slow to walk.
    live = [[i] for i in range(500_000)]
    gc.unfreeze()  # (collections while building them may have frozen them already)
    watcher.clear()
    slow_ms = _full_collection_ms()
    assert watcher, f"a {slow_ms:.1f} ms full collection froze nothing"
    assert watcher[-1][1] >= len(live)  # the survivors are frozen
    assert gc.get_freeze_count() >= len(live)
    # Later full collections skip them.
    fast_ms = min(_full_collection_ms() for _ in range(3))
    assert fast_ms < slow_ms / 5, (slow_ms, fast_ms)
    # Frozen objects are still freed by reference counting.
    del live
    assert gc.get_freeze_count() < 500_000


def test_installing_twice_installs_once(watcher: list[tuple[float, int]]) -> None:
    before = len(gc.callbacks)
    gctune.freeze_after_slow_collections()
    assert len(gc.callbacks) == before


def test_a_forked_child_does_nothing(watcher: list[tuple[float, int]]) -> None:
    # A master's snapshot writer is a forked child: it must not log or freeze.
    import os

    live = [[i] for i in range(300_000)]
    gc.unfreeze()
    watcher.clear()
    pid = os.fork()
    if pid == 0:  # the child: a slow full collection, then report whether anything ran
        gc.collect()
        os._exit(3 if watcher else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the watcher acted in a forked child"
    del live
