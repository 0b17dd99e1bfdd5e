"""The chaos runs of this machine: one marker per run under ``/run/kvpool-chaos/``, and the host
state the runs share.

A marker (``<run>.json``) names the run's owner (pid and start time, so a reused pid is not
mistaken for it), its subnet, what it created and the pids it started. It is written before the
run creates anything, so a crash at any point leaves a listed leftover; a run whose owner is
gone is stale. Every change goes under one ``flock`` (``.lock``), so concurrent runs on one
machine pick distinct subnets and agree on who restores the shared sysctl.

The shared state: ``net.bridge.bridge-nf-call-iptables``. With br_netfilter loaded (Docker loads
it) and the sysctl at 1, bridged frames go through the IP firewall's forward hook, where a host
policy (Docker's FORWARD DROP) would drop them; an accept rule of ours cannot override a drop of
another table. The first live run sets it to 0 and saves the old value; the last one to close
(or a stale clean-up with no live run left) puts it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool.launcher.procfs import process_start_ticks
from kvpool.logs import get_logger

RUN_DIR = Path("/run/kvpool-chaos")
BRIDGE_NF_SYSCTL = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
_SAVED_SYSCTL = "bridge-nf-call-iptables.saved"


def owner_alive(pid: int, start_ticks: int | None) -> bool:
    """True when ``pid`` runs and (if given) started at ``start_ticks``: the same process."""
    ticks = process_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)


def marker_alive(doc: dict[str, Any]) -> bool:
    return owner_alive(int(doc.get("pid", 0)), doc.get("start_ticks"))


class RunRegistry:
    """The markers in ``state_dir`` (default ``/run/kvpool-chaos``)."""

    def __init__(self, state_dir: str | Path = RUN_DIR) -> None:
        self.dir = Path(state_dir)
        self.log = get_logger("kvpool.chaos.runs")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the registry's lock (every marker and sysctl change goes under it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def write(self, run_id: str, owner_pid: int, doc: dict[str, Any]) -> None:
        """Write ``run_id``'s marker whole (the owner's pid and start time added)."""
        full = {
            "run_id": run_id,
            "pid": owner_pid,
            "start_ticks": process_start_ticks(owner_pid),
            "written_wall_s": time.time(),
            **doc,
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(run_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(full) + "\n")
        tmp.replace(self.path(run_id))

    def remove(self, run_id: str) -> None:
        with contextlib.suppress(OSError):
            self.path(run_id).unlink()

    def markers(self) -> list[dict[str, Any]]:
        docs = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and doc.get("run_id"):
                docs.append(doc)
        return docs

    def live_runs(self) -> set[str]:
        return {str(d["run_id"]) for d in self.markers() if marker_alive(d)}

    def subnets(self) -> list[ipaddress.IPv4Network]:
        """The subnets every marker holds (a run still setting up has no route yet)."""
        nets = []
        for doc in self.markers():
            with contextlib.suppress(ValueError):
                if doc.get("subnet"):
                    nets.append(ipaddress.IPv4Network(doc["subnet"]))
        return nets

    # --- the shared sysctl (call under ``locked()``) -------------------------------------------

    def disable_bridge_nf(self) -> None:
        """Set bridge-nf-call-iptables to 0, saving its value, unless a run already did."""
        saved = self.dir / _SAVED_SYSCTL
        if not BRIDGE_NF_SYSCTL.exists() or saved.exists():
            return
        value = BRIDGE_NF_SYSCTL.read_text().strip()
        if value != "0":
            saved.write_text(value + "\n")
            BRIDGE_NF_SYSCTL.write_text("0\n")
            self.log.info("bridge_nf_disabled", sysctl=str(BRIDGE_NF_SYSCTL), was=value)

    def restore_bridge_nf(self, closing_run: str = "") -> None:
        """Put the saved value back when no live run other than ``closing_run`` is left."""
        saved = self.dir / _SAVED_SYSCTL
        if not saved.exists() or self.live_runs() - {closing_run}:
            return
        value = saved.read_text().strip()
        if BRIDGE_NF_SYSCTL.exists():
            BRIDGE_NF_SYSCTL.write_text(value + "\n")
        saved.unlink()
        self.log.info("bridge_nf_restored", sysctl=str(BRIDGE_NF_SYSCTL), value=value)
