"""Keep CPython's full garbage collections short in a process that holds many live objects.

A full (generation 2) collection walks every container object the process holds. A store node
keeps three per block (the block, its copies dict, a copy): with a million blocks one full
collection took 0.78 s here, and every request waits it out; a client process walks its ~57k
import-time objects (grpc, protobuf, numpy…) in ~30 ms, which a loop of batched gets triggers
about every 0.75 s (measured: both clients of a two-process benchmark stalled together).

:func:`freeze_after_slow_collections` watches full collections; after one slower than a
threshold, it freezes what survived (``gc.freeze()``: moved to the permanent generation, which
later collections skip). Right after a full collection everything left is alive, so nothing
collectable is frozen; the next slow collection freezes again, so the frozen set follows the
heap's growth rather than the clock. Frozen objects are still freed by reference counting when
they are dropped; only a reference *cycle* among them that dies is never collected — the node
breaks its block↔copy cycle when a copy is freed, so dropped blocks do not leak.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_installed: Callable[[str, dict[str, Any]], None] | None = None


class GcStats:
    """What the watcher did (read from any thread)."""

    full_collections = 0
    slow_collections = 0
    freezes = 0
    longest_ms = 0.0


STATS = GcStats()


def freeze_after_slow_collections(
    threshold_ms: float = 5.0, on_freeze: Callable[[float, int], None] | None = None
) -> None:
    """Install the watcher (once per process; later calls change nothing). ``on_freeze(ms,
    frozen)`` is told the slow collection's duration and how many objects are now frozen —
    called inside the collector: it must not allocate much or block."""
    global _installed
    with _lock:
        if _installed is not None:
            return
        started = [0.0]
        owner = os.getpid()

        def watch(phase: str, info: dict[str, Any]) -> None:
            # Not in a forked child (a master's snapshot writer must only pickle and exit: no
            # logging, whose locks another thread may have held at the fork).
            if info.get("generation") != 2 or os.getpid() != owner:
                return
            if phase == "start":
                started[0] = time.perf_counter()
                return
            took_ms = (time.perf_counter() - started[0]) * 1e3
            STATS.full_collections += 1
            STATS.longest_ms = max(STATS.longest_ms, took_ms)
            if took_ms < threshold_ms:
                return
            STATS.slow_collections += 1
            gc.freeze()
            STATS.freezes += 1
            if on_freeze is not None:
                on_freeze(took_ms, gc.get_freeze_count())

        gc.callbacks.append(watch)
        _installed = watch


def uninstall() -> None:
    """Remove the watcher and unfreeze (tests)."""
    global _installed
    with _lock:
        if _installed is not None:
            gc.callbacks.remove(_installed)
            _installed = None
        gc.unfreeze()
