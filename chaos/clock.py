"""Clock jumps on one process: its wall clock steps forward or back, as an NTP step would, while
its monotonic clock runs on.

A process started with :meth:`FakeClocks.env_for` has libfaketime preloaded and reads its offset
from its own file (``FAKETIME_TIMESTAMP_FILE``, re-read on every call: ``FAKETIME_NO_CACHE=1``);
``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves ``CLOCK_MONOTONIC`` alone. :meth:`FakeClocks.jump`
writes ``+3600`` / ``-3600`` (seconds relative to the real clock) into that file.

libfaketime 0.9.10 (Debian 12's) with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` turns
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` into EINVAL (wolfcw/libfaketime#426) — and
that is how ``time.sleep`` sleeps since Python 3.11. The environment therefore also puts a
``sitecustomize`` on ``PYTHONPATH`` that checks ``time.sleep`` at start and, only when it fails
that way, replaces it with a ``select``-based sleep with the same contract.

libfaketime keeps a shared-memory segment and a semaphore per process under /dev/shm, removed
at a clean exit; :func:`remove_faketime_shm` removes those of a process that was killed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvpool.errors import KVPoolError

LIBFAKETIME_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
SHM_DIR = Path("/dev/shm")  # noqa: S108 - where libfaketime keeps its segments

SLEEP_SHIM = '''\
"""Installed by kvpool.chaos.clock for processes under libfaketime: with
FAKETIME_DONT_FAKE_MONOTONIC=1, libfaketime 0.9.10 fails clock_nanosleep(CLOCK_MONOTONIC,
TIMER_ABSTIME) with EINVAL (wolfcw/libfaketime#426), which time.sleep uses since Python 3.11."""

import select as _select
import time as _time


def _check():
    try:
        _time.sleep(0.0001)
    except OSError:
        return False
    return True


if not _check():
    _monotonic = _time.monotonic

    def sleep(seconds):
        """time.sleep through select(): relative timeouts, untouched by libfaketime."""
        seconds = float(seconds)
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = _monotonic() + seconds
        while True:
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return
            _select.select([], [], [], remaining)

    _time.sleep = sleep
'''


class ClockError(KVPoolError):
    """A clock could not be faked or moved as asked."""

    code = "CHAOS_CLOCK"


def find_libfaketime() -> str | None:
    """The libfaketime preload library on this machine (``KVPOOL_LIBFAKETIME`` overrides)."""
    override = os.environ.get("KVPOOL_LIBFAKETIME")
    if override:
        return override if Path(override).is_file() else None
    for candidate in LIBFAKETIME_CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    return None


def format_offset(offset_s: float) -> str:
    """libfaketime's relative offset syntax: ``+3600``, ``-0.5``."""
    if offset_s == int(offset_s):
        return f"{int(offset_s):+d}"
    return f"{offset_s:+.6f}"


def remove_faketime_shm(pid: int) -> None:
    """Remove libfaketime's shared memory of ``pid`` (left behind when it was killed)."""
    if Path(f"/proc/{pid}").exists():
        return
    for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()


class FakeClocks:
    """A fake wall clock per process name, in ``directory``."""

    def __init__(self, directory: str | Path, *, library: str | None = None) -> None:
        self.dir = Path(directory).resolve()
        self.library = library or find_libfaketime()
        self._offsets: dict[str, float] = {}

    @property
    def available(self) -> bool:
        return self.library is not None

    @property
    def unavailable_reason(self) -> str:
        if self.available:
            return ""
        return "libfaketime not found (install the faketime package)"

    @property
    def names(self) -> list[str]:
        return list(self._offsets)

    def _file(self, name: str) -> Path:
        return self.dir / f"{name}.faketime"

    def env_for(self, name: str) -> dict[str, str]:
        """The environment that runs a process under its own fake clock (offset 0 at first)."""
        if self.library is None:
            raise ClockError(self.unavailable_reason)
        self.dir.mkdir(parents=True, exist_ok=True)
        shim = self.dir / "site"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
        if name not in self._offsets:
            self._write(name, 0.0)
        python_path = os.environ.get("PYTHONPATH", "")
        return {
            "LD_PRELOAD": self.library,
            "FAKETIME_TIMESTAMP_FILE": str(self._file(name)),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": f"{shim}:{python_path}" if python_path else str(shim),
        }

    def jump(self, name: str, offset_s: float) -> None:
        """Set ``name``'s wall clock to the real one plus ``offset_s`` (0 puts it back)."""
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
        tmp.replace(path)  # whole or not at all: the process re-reads it on every call
        self._offsets[name] = offset_s
