"""A master's metrics, read at scrape time (see :mod:`kvpool.metrics`): Raft role, term, commit
index, applied index, log size, readiness, follower lag; index entries, revision, live nodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from kvpool.metrics import counter, gauge
from kvpool.raft_master.service import MasterService

ROLES = ("leader", "follower", "candidate")


def master_families(service: MasterService, replicas: Any = None) -> Iterator[Metric]:
    """Every family a master serves besides the RPC latency histogram (``replicas``: the
    :class:`~kvpool.raft_master.replica_loop.ReplicaLoop`, whose work the leader counts)."""
    status = service.master_status()
    raft = service.replicator.status()
    role = gauge("kvpool_raft_role", "1 for this master's current Raft role", ["role"])
    for name in ROLES:
        role.add_metric([name], 1.0 if status.role == name else 0.0)
    yield role
    yield _one("kvpool_raft_term", "current Raft term", status.term)
    yield _one("kvpool_raft_commit_index", "Raft commit index", status.commit_index)
    yield _one("kvpool_raft_last_applied_index", "last Raft entry applied", status.last_applied)
    yield _one(
        "kvpool_raft_log_size_entries", "Raft log entries kept since compaction", status.log_size
    )
    yield _one(
        "kvpool_raft_ready",
        "1 when a leader is known and this master has caught up (gRPC readiness)",
        1 if status.ready else 0,
    )
    yield _one("kvpool_raft_has_quorum", "1 when the leader sees a quorum", int(raft.has_quorum))
    counts = service.replicator.election_counts()
    for name, key, doc in (
        (
            "kvpool_raft_prevotes",
            "prevotes_started",
            "pre-vote rounds this master started (its election timer ran out: no leader heard)",
        ),
        (
            "kvpool_raft_votes_refused",
            "votes_refused",
            "vote requests this master ignored while promised to a leader (read leases)",
        ),
        (
            "kvpool_raft_stale_appends_answered",
            "stale_appends_answered",
            "appends of an older term this master answered with its own (it was ahead)",
        ),
        (
            "kvpool_raft_stepdowns",
            "stepped_down",
            "times this master, leading, stepped down for a master at a higher term",
        ),
    ):
        yield _total(name, doc, counts[key])
    lag = gauge(
        "kvpool_raft_follower_lag_entries",
        "leader only: commit index minus each follower's match index",
        ["follower"],
    )
    for follower, match in sorted(status.follower_match_index.items()):
        lag.add_metric([follower], float(max(0, status.commit_index - match)))
    yield lag
    yield _one("kvpool_index_entries", "blocks in the index", status.entries)
    yield _one("kvpool_index_revision", "index revision (every change bumps it)", status.revision)
    yield _one(
        "kvpool_index_max_entries",
        "entries at which this master, leading, refuses puts of new keys (index_max_entries)",
        service.index_limit,
    )
    yield _total(
        "kvpool_index_full_refusals",
        "puts refused by this master because the index was at index_max_entries",
        service.index_full_refusals,
    )
    yield _total(
        "kvpool_index_shed_asked",
        "blocks this master, leading, asked nodes to drop because the index was past nine "
        "tenths of index_max_entries (index_shed)",
        service.index_shed_asked,
    )
    members = service.replicator.read(lambda ix: len(ix.live_members()))
    yield _one("kvpool_index_live_nodes", "store nodes the index counts as live", members)
    if replicas is not None:
        for name, attr, doc in (
            ("kvpool_replica_repairs", "copies_total", "replicas copied by this master's loop"),
            ("kvpool_replica_copy_failures", "copy_failures_total", "replica copies that failed"),
            ("kvpool_replica_releases", "releases_total", "extra replicas released"),
        ):
            yield _total(name, doc, getattr(replicas, attr, 0))
        yield _one(
            "kvpool_replica_under_target_blocks",
            "blocks below their replica target at the last pass (leader)",
            getattr(replicas, "under_target", 0),
        )


def _one(name: str, doc: str, value: float) -> Metric:
    family = gauge(name, doc)
    family.add_metric([], float(value))
    return family


def _total(name: str, doc: str, value: float) -> Metric:
    family = counter(name, doc)
    family.add_metric([], float(value))
    return family
