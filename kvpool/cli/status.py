"""``kvpool status``: the cluster at a glance — masters (role, term, commit index, lag) and
store nodes (hit rate, blocks, fill of each tier with the 85 % alarm highlighted) — as a table,
refreshed with ``--watch``, or with ``--json`` for scripts."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict

from kvpool.launcher.probe import MasterProbe, NodeProbe, leader_of, probe_masters, probe_nodes
from kvpool.security import Security
from kvpool.units import format_size

ALARM_FILL = 0.85


def collect_status(
    masters: Sequence[str], timeout_s: float = 1.0, security: Security | None = None
) -> dict[str, Any]:
    """Ask every master, then every live node's admin service (its tiers). ``security``: the
    cluster token and TLS files (default: from the environment)."""
    probes = probe_masters(masters, timeout_s=timeout_s, security=security)
    doc = status_document(probes)
    admins = [n["admin_address"] for n in doc["nodes"] if n["admin_address"]]
    if admins:
        add_node_stats(doc, probe_nodes(admins, timeout_s=timeout_s, security=security))
    return doc


def add_node_stats(doc: dict[str, Any], probes: Sequence[NodeProbe]) -> None:
    """Each node's tiers (fill, blocks) and counters from its own GetStats answer."""
    by_admin = {p.address: p for p in probes}
    for node in doc["nodes"]:
        probe = by_admin.get(node["admin_address"])
        if probe is None or probe.stats is None:
            node["tiers"] = []
            continue
        stats = probe.stats
        node["hits"], node["misses"] = stats.hits_total, stats.misses_total
        node["hit_rate"] = _rate(stats.hits_total, stats.misses_total)
        node["tiers"] = [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "fill": (t.used_bytes / t.capacity_bytes) if t.capacity_bytes else 0.0,
                "blocks": t.block_count,
                "high_watermark": t.high_watermark,
            }
            for t in stats.tiers
        ]


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def status_document(probes: Sequence[MasterProbe]) -> dict[str, Any]:
    """Everything ``status`` knows, as plain data (the ``--json`` output)."""
    leader = leader_of(probes)
    source = leader or next((p for p in probes if p.status is not None), None)
    masters = []
    leader_commit = leader.status.master.commit_index if leader and leader.status else None
    for p in probes:
        if p.status is None:
            masters.append({"address": p.address, "reachable": False, "error": p.error})
            continue
        m = p.status.master
        masters.append(
            {
                "address": p.address,
                "reachable": True,
                "role": m.role,
                "term": m.term,
                "commit_index": m.commit_index,
                "last_applied": m.last_applied,
                "lag": (leader_commit - m.last_applied) if leader_commit is not None else None,
                "ready": m.ready,
                "revision": m.revision,
                "entries": m.entries,
                "max_entries": m.max_entries,
                "log_size": m.log_size,
                "raft_address": m.raft_address,
            }
        )
    nodes = []
    if source is not None and source.status is not None:
        for n in source.status.nodes:
            member = n.member
            cap = member.capacity_bytes
            nodes.append(
                {
                    "node_id": member.node_id,
                    "member_id": member.member_id,
                    "state": "draining" if member.draining else "live",
                    "data_address": member.data_address,
                    "admin_address": member.admin_address,
                    "zone": member.zone,
                    "capacity_bytes": cap,
                    "used_bytes": n.used_bytes,
                    "fill": (n.used_bytes / cap) if cap else 0.0,
                    "blocks": n.block_count,
                    "hits": n.hits_total,
                    "misses": n.misses_total,
                    "hit_rate": _rate(n.hits_total, n.misses_total),
                    "tiers": [],
                    "evictions": n.evictions_total,
                    "last_heartbeat_age_s": n.last_heartbeat_age_s,
                }
            )
    return {
        "leader": leader.address if leader else None,
        "ring_version": source.status.ring_version if source and source.status else None,
        "masters": masters,
        "nodes": nodes,
        "raw": {p.address: MessageToDict(p.status) for p in probes if p.status is not None},
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


ALARM_ON, ALARM_OFF = "\033[1;41;97m", "\033[0m"  # bold white on red, when on a terminal


def _keys(entries: int, limit: int, color: bool) -> str:
    """A master's index entries, and how full they make it against ``index_max_entries``
    (at the limit the leader refuses puts of new keys); alarmed from 85 %, as a tier."""
    if not limit:  # a master of an older release does not say
        return str(entries)
    return f"{entries} of {limit} ({_fill(entries / limit, color)})"


def _fill(fill: float, color: bool) -> str:
    text = f"{fill:.0%}"
    if fill < ALARM_FILL:
        return text
    alarm = f"{text} !ALARM"
    return f"{ALARM_ON}{alarm}{ALARM_OFF}" if color else alarm


def render_status(doc: dict[str, Any], *, color: bool = False) -> str:
    """The status as text; ``color`` highlights tiers at or above the 85 % alarm (a terminal)."""
    lines = []
    leader = doc["leader"] or "none (no quorum, or an election is under way)"
    lines.append(f"leader: {leader}    ring version: {doc['ring_version']}")
    lines.append("")
    rows = [["MASTER", "ROLE", "TERM", "COMMIT", "APPLIED", "LAG", "READY", "KEYS"]]
    for m in doc["masters"]:
        if not m["reachable"]:
            rows.append([m["address"], "unreachable", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                m["address"],
                m["role"],
                str(m["term"]),
                str(m["commit_index"]),
                str(m["last_applied"]),
                "-" if m["lag"] is None else str(m["lag"]),
                "yes" if m["ready"] else "no",
                _keys(m["entries"], m.get("max_entries", 0), color),
            ]
        )
    lines.append(_table(rows))
    lines.append("")
    if not doc["nodes"]:
        lines.append("no live store nodes")
        return "\n".join(lines)
    rows = [
        ["NODE", "MEMBER", "STATE", "DATA ADDRESS", "HIT RATE", "BLOCKS", "TIER", "USED", "FILL"]
    ]
    for n in doc["nodes"]:
        rate = "-" if n.get("hit_rate") is None else f"{n['hit_rate']:.1%}"
        state = n.get("state", "live")  # "draining": readable, takes no new puts
        head = [
            n["node_id"],
            str(n["member_id"]),
            state,
            n["data_address"],
            rate,
            str(n["blocks"]),
        ]
        tiers = n.get("tiers") or [
            {
                "name": "all",
                "capacity_bytes": n["capacity_bytes"],
                "used_bytes": n["used_bytes"],
                "fill": n["fill"],
            }
        ]
        for i, t in enumerate(tiers):
            used = f"{format_size(t['used_bytes'])} / {format_size(t['capacity_bytes'])}"
            rows.append(
                [*(head if i == 0 else [""] * len(head)), t["name"], used, _fill(t["fill"], color)]
            )
    lines.append(_table(rows))
    return "\n".join(lines)


CLEAR_SCREEN = "\033[H\033[2J"


def watch_status(
    masters: Sequence[str],
    interval_s: float,
    *,
    timeout_s: float = 1.0,
    as_json: bool = False,
    out: TextIO | None = None,
    rounds: int | None = None,
) -> int:
    """Print the status every ``interval_s`` (the screen cleared first on a terminal) until
    Ctrl-C, which exits 0; ``rounds`` bounds the loop (tests).

    In the main thread Ctrl-C only asks the loop to stop: a round being collected ends first
    (within ``timeout_s``). Raised inside a round, KeyboardInterrupt could land while
    ``asyncio.run`` was closing its loop, and the loop, left running, printed a traceback when
    the interpreter collected it."""
    stream = out if out is not None else sys.stdout
    tty = stream.isatty()
    done = 0
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    try:
        while (rounds is None or done < rounds) and not stop.is_set():
            doc = collect_status(masters, timeout_s=timeout_s)
            if stop.is_set():
                break
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            text = (
                json.dumps(doc, default=str)
                if as_json
                else f"kvpool status  {stamp}  (every {interval_s:g} s, Ctrl-C to stop)\n\n"
                + render_status(doc, color=tty)
            )
            stream.write((CLEAR_SCREEN if tty and not as_json else "") + text + "\n")
            stream.flush()
            done += 1
            if rounds is None or done < rounds:
                stop.wait(interval_s)
    except KeyboardInterrupt:  # before the handler was in place, or outside the main thread
        stop.set()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        stream.write("\n")
        stream.flush()
    return 0
