"""What /proc says about a pid the launcher started: is it still a kvpool process, is it
stopped, when did it start (which tells a pid from its reuse)."""

from __future__ import annotations

from pathlib import Path


def pid_runs_kvpool(pid: int) -> bool:
    """True when ``pid`` is alive and its command line is a kvpool process."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if not cmdline:  # a zombie
        return False
    return b"kvpool" in cmdline


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name, from field 3 (state) on."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[-1].split()


def process_state(pid: int) -> str:
    """The state letter of ``pid`` (``T``/``t``: stopped), or "" when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else ""


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None when it is gone."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19])  # field 22 of proc(5)'s stat
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start_ticks: int | None) -> bool:
    """True while ``pid`` is still the process that started at ``start_ticks`` and has not
    exited: not gone, not a zombie, not a new process under a reused pid. (``/proc/PID/cmdline``
    is empty as soon as an exiting process has released its memory, while it still holds its
    files and listening ports: it cannot tell "exited".)"""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X", "x"):
        return False
    if start_ticks is None:
        return True
    try:
        return int(fields[19]) == start_ticks
    except (IndexError, ValueError):
        return False
