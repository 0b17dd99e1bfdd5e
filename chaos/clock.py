"""Clock jumps on one process: its wall clock steps forward or back, as an NTP step would, while
its monotonic clock runs on.

A process started with :meth:`FakeClocks.env_for` gets a ``sitecustomize`` on its
``PYTHONPATH`` that shifts Python's wall clock (``time.time``, ``time.time_ns``) by an offset
read from its own file, re-read every 50 ms by a daemon thread; :meth:`FakeClocks.jump` writes
``+3600`` / ``-3600`` (seconds relative to the real clock) into that file. ``time.monotonic``,
``time.perf_counter`` and every C-level clock are left alone.

Why not libfaketime (``LD_PRELOAD``, Debian's ``faketime``), which fakes the C library's clock
for the whole process? It perturbs the processes it is meant to observe. Measured here on a
healthy 3-master, 2-node cluster under load, every process preloaded, offset 0, no jump at all:
10,217 put+get pairs in 20 s without it, 471 with ``FAKETIME_NO_CACHE=1`` (every clock call
re-reads the file) and 3,881 with a 1 s cache; gRPC calls stalled until their deadline (p99 =
the client's 1 s attempt timeout) and the masters fell into election storms (terms 8 to 32).
libfaketime 0.9.10 also breaks ``time.sleep`` with ``FAKETIME_DONT_FAKE_MONOTONIC=1``
(wolfcw/libfaketime#426). A fault injector that destabilises every process cannot show that a
clock jump changes nothing, so this module moves the clock that kvpool's own decisions could
read — Python's wall clock, in our code and in PySyncObj — and nothing else. gRPC's C core
times its deadlines and timers with the monotonic clock, which a real NTP step does not move
either.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.errors import KVPoolError

CLOCK_FILE_ENV = "KVPOOL_FAKE_CLOCK_FILE"
POLL_INTERVAL_S = 0.05

CLOCK_SHIM = '''\
"""Installed by kvpool.chaos.clock: shift this process's Python wall clock (time.time,
time.time_ns) by the offset in $KVPOOL_FAKE_CLOCK_FILE, re-read every 50 ms. The monotonic
clock is untouched, as an NTP step leaves it."""

import os as _os
import threading as _threading
import time as _time

_path = _os.environ.get("KVPOOL_FAKE_CLOCK_FILE")
if _path:
    _real_time = _time.time
    _real_time_ns = _time.time_ns
    _offset_s = [0.0]

    def _read_offset():
        try:
            with open(_path) as fh:
                _offset_s[0] = float(fh.read().strip() or 0)
        except (OSError, ValueError):
            pass  # keep the last offset: the file is replaced whole, never half-written

    def _follow():
        while True:
            _time.sleep(POLL_INTERVAL_S)
            _read_offset()

    def time():
        """time.time, shifted by the fake clock's offset."""
        return _real_time() + _offset_s[0]

    def time_ns():
        """time.time_ns, shifted by the fake clock's offset."""
        return _real_time_ns() + int(_offset_s[0] * 1_000_000_000)

    _read_offset()
    _threading.Thread(target=_follow, name="kvpool-fake-clock", daemon=True).start()
    _time.time = time
    _time.time_ns = time_ns
'''.replace("POLL_INTERVAL_S", repr(POLL_INTERVAL_S))


class ClockError(KVPoolError):
    """A clock could not be faked or moved as asked."""

    code = "CHAOS_CLOCK"


def format_offset(offset_s: float) -> str:
    """``+3600``, ``-0.5``: the offset as written into a clock file."""
    if offset_s == int(offset_s):
        return f"{int(offset_s):+d}"
    return f"{offset_s:+.6f}"


class FakeClocks:
    """A fake wall clock per process name, in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).resolve()
        self._offsets: dict[str, float] = {}

    @property
    def available(self) -> bool:
        return True  # needs nothing but Python

    @property
    def unavailable_reason(self) -> str:
        return ""

    @property
    def names(self) -> list[str]:
        return list(self._offsets)

    def _file(self, name: str) -> Path:
        return self.dir / f"{name}.clock"

    def env_for(self, name: str, python_path: str | None = None) -> dict[str, str]:
        """The environment that runs a process under its own fake clock (offset 0 at first).
        ``python_path`` is the PYTHONPATH the process would have had (default: ours)."""
        if python_path is None:
            python_path = os.environ.get("PYTHONPATH", "")
        self.dir.mkdir(parents=True, exist_ok=True)
        shim = self.dir / "site"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(CLOCK_SHIM)
        if name not in self._offsets:
            self._write(name, 0.0)
        return {
            CLOCK_FILE_ENV: str(self._file(name)),
            "PYTHONPATH": f"{shim}:{python_path}" if python_path else str(shim),
        }

    def jump(self, name: str, offset_s: float) -> None:
        """Set ``name``'s wall clock to the real one plus ``offset_s`` (0 puts it back). The
        process sees it within POLL_INTERVAL_S."""
        if name not in self._offsets:
            raise ClockError(f"{name} was not started with a fake clock")
        self._write(name, offset_s)

    def offset_of(self, name: str) -> float:
        return self._offsets.get(name, 0.0)

    def reset_all(self) -> None:
        for name in list(self._offsets):
            self._write(name, 0.0)

    def _write(self, name: str, offset_s: float) -> None:
        path = self._file(name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(format_offset(offset_s) + "\n")
        tmp.replace(path)  # whole or not at all: the process re-reads it every 50 ms
        self._offsets[name] = offset_s
