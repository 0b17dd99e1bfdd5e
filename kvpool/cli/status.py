"""``kvpool status``: the cluster at a glance — masters (role, term, commit index, lag) and
store nodes (capacity, used, blocks) — as a table or, with ``--json``, for scripts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict

from kvpool.launcher.probe import MasterProbe, leader_of
from kvpool.units import format_size

ALARM_FILL = 0.85


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
                    "data_address": member.data_address,
                    "zone": member.zone,
                    "capacity_bytes": cap,
                    "used_bytes": n.used_bytes,
                    "fill": (n.used_bytes / cap) if cap else 0.0,
                    "blocks": n.block_count,
                    "hits": n.hits_total,
                    "misses": n.misses_total,
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


def render_status(doc: dict[str, Any]) -> str:
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
                str(m["entries"]),
            ]
        )
    lines.append(_table(rows))
    lines.append("")
    if not doc["nodes"]:
        lines.append("no live store nodes")
    else:
        rows = [["NODE", "MEMBER", "DATA ADDRESS", "CAPACITY", "USED", "FILL", "BLOCKS", "HITS"]]
        for n in doc["nodes"]:
            fill = f"{n['fill']:.0%}" + ("  !ALARM" if n["fill"] >= ALARM_FILL else "")
            rows.append(
                [
                    n["node_id"],
                    str(n["member_id"]),
                    n["data_address"],
                    format_size(n["capacity_bytes"]),
                    format_size(n["used_bytes"]),
                    fill,
                    str(n["blocks"]),
                    str(n["hits"]),
                ]
            )
        lines.append(_table(rows))
    return "\n".join(lines)
