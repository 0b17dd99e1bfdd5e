"""What the cluster went through and where it ended, as the checkers need it: the final state
once faults have healed, the fault windows, and the runner's probes after healing.

:func:`collect_final_state` asks every master for its ClusterStatus until they agree (same
commit index and applied revision) or a time limit passes, then asks the leader for the node
table (with each node's eviction counter, also asked of the node itself) and for the index entry
of every key of the key space (Lookup in batches, on the leader, any master if it fails). It
calls the masters' gRPC service directly (no client SDK API), so nothing in the answer is
filtered by a client's cache or read floor.

:func:`logged_evictions` reads from the nodes' logs which members evicted blocks during the
run: a node restarted by a fault comes back as a new member, and the counters the final state
asks for are those of the last one.

:func:`fault_windows` turns a nemesis's inject/heal steps into :class:`FaultWindow` intervals.
:func:`sample_masters` and :func:`verify_reads` are the probes a runner takes after healing,
for the convergence checker (:class:`CommitSample`, :class:`HitRateSample`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.chaos.values import ValueId, decode_value
from kvpool.errors import KVPoolError
from kvpool.launcher.probe import MasterProbe, leader_of, probe_masters_async, probe_nodes_async
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.security import env_security

LOOKUP_BATCH = 256
"""Keys per Lookup of the final pass."""

EVICTED_EVENT = "blocks_evicted"
"""What a node logs (with its ``member_id``) before it reports evicted blocks to the masters."""


def logged_evictions(logs: Iterable[str]) -> frozenset[int]:
    """The member ids that the JSON logs at ``logs`` (nodes', every incarnation appending to
    its file) say evicted blocks: every member whose entries an eviction removed from the
    index, including members gone by the end. A missing file or a line that is not JSON is
    passed over."""
    members: set[int] = set()
    for path in logs:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if EVICTED_EVENT not in line:
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict) and event.get("event") == EVICTED_EVENT:
                        member = event.get("member_id")
                        if isinstance(member, int) and event.get("count", 1):
                            members.add(member)
        except OSError:
            continue
    return frozenset(members)


@dataclass(frozen=True, slots=True)
class MasterState:
    """One master's answer to ClusterStatus (``error`` set when it did not answer)."""

    address: str
    role: str = ""
    term: int = 0
    commit_index: int = 0
    last_applied: int = 0
    revision: int = 0
    leader: str = ""
    error: str = ""

    @property
    def answered(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class NodeState:
    """A live member of the index at the end. ``evictions_total`` is None when unknown."""

    member_id: int
    node_id: str
    incarnation: int
    data_address: str = ""
    admin_address: str = ""
    evictions_total: int | None = None


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """A key's entry as the leader answered it (``member_ids``: its live replicas)."""

    version: int
    write_id: int
    member_ids: tuple[int, ...]


@dataclass
class FinalState:
    """What the cluster holds after healing. ``entries`` maps every queried key to its entry,
    or None when the index has none (absent, or every replica on a member that is down);
    ``unresolved`` lists keys no master answered for. ``settled_t`` is when the masters were
    first seen to agree (None: not within the limit), ``started_t`` when the collector began to
    look. ``nodes_known``: the node table was read."""

    t: float
    masters: list[MasterState] = field(default_factory=list)
    leader: str | None = None
    nodes: list[NodeState] = field(default_factory=list)
    nodes_known: bool = False
    entries: dict[str, IndexEntry | None] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)
    settled_t: float | None = None
    started_t: float | None = None
    ring_version: int = 0

    def live_member_ids(self) -> set[int]:
        return {n.member_id for n in self.nodes}

    def node(self, member_id: int) -> NodeState | None:
        for n in self.nodes:
            if n.member_id == member_id:
                return n
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "masters": [_slots_dict(m) for m in self.masters],
            "leader": self.leader,
            "nodes": [_slots_dict(n) for n in self.nodes],
            "nodes_known": self.nodes_known,
            "entries": {
                k: None if e is None else [e.version, e.write_id, list(e.member_ids)]
                for k, e in self.entries.items()
            },
            "unresolved": list(self.unresolved),
            "settled_t": self.settled_t,
            "started_t": self.started_t,
            "ring_version": self.ring_version,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> FinalState:
        entries: dict[str, IndexEntry | None] = {}
        for key, e in raw.get("entries", {}).items():
            entries[key] = None if e is None else IndexEntry(int(e[0]), int(e[1]), tuple(e[2]))
        return cls(
            t=float(raw["t"]),
            masters=[MasterState(**m) for m in raw.get("masters", [])],
            leader=raw.get("leader"),
            nodes=[NodeState(**n) for n in raw.get("nodes", [])],
            nodes_known=bool(raw.get("nodes_known", False)),
            entries=entries,
            unresolved=list(raw.get("unresolved", [])),
            settled_t=raw.get("settled_t"),
            started_t=raw.get("started_t"),
            ring_version=int(raw.get("ring_version", 0)),
        )


# --- what the cluster went through: faults and probes ----------------------------------------


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """A fault the nemesis injected: ``kind`` (kill, pause, partition, slow_link, clock, …) on
    ``targets`` (process names: node ids such as ``node-1``, master names such as
    ``master-2``), from ``start_t`` (injected) until ``end_t`` (healed; None: never healed).
    :func:`fault_windows` builds them from a nemesis's inject and heal steps."""

    kind: str
    targets: tuple[str, ...]
    start_t: float
    end_t: float | None = None
    name: str = ""

    def affects_after(self, target: str, t: float) -> bool:
        """Whether this fault touched ``target`` at or after time ``t``."""
        return target in self.targets and (self.end_t is None or self.end_t >= t)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "targets": list(self.targets),
            "start_t": self.start_t,
            "end_t": self.end_t,
            "name": self.name,
        }


def _field(step: Any, name: str, default: Any = None) -> Any:
    if isinstance(step, Mapping):
        return step.get(name, default)
    return getattr(step, name, default)


def fault_windows(steps: Iterable[Any]) -> list[FaultWindow]:
    """One window per injected fault, from a nemesis's steps (objects or JSON mappings with
    ``seq``, ``phase`` "inject"/"heal", ``fault`` (name), ``kind``, ``targets``,
    ``monotonic_s``, ``outcome`` and, on a heal, ``heals``: the seq of the inject it undoes).
    A skipped inject did nothing and has no window; one that failed may have acted halfway and
    keeps one. An inject with no heal stays open."""
    steps = list(steps)
    healed: dict[int, float] = {}
    for step in steps:
        if _field(step, "phase") == "heal" and _field(step, "heals") is not None:
            seq = int(_field(step, "heals"))
            healed[seq] = max(healed.get(seq, 0.0), float(_field(step, "monotonic_s")))
    windows = []
    for step in steps:
        if _field(step, "phase") != "inject" or _field(step, "outcome") == "skipped":
            continue
        windows.append(
            FaultWindow(
                kind=str(_field(step, "kind", "")),
                targets=tuple(str(t) for t in _field(step, "targets", ())),
                start_t=float(_field(step, "monotonic_s")),
                end_t=healed.get(int(_field(step, "seq", -1))),
                name=str(_field(step, "fault", "")),
            )
        )
    return windows


@dataclass(frozen=True, slots=True)
class CommitSample:
    """One probe of every master: its commit index and applied revision (None: no answer)."""

    t: float
    commit_index: Mapping[str, int | None]
    revision: Mapping[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HitRateSample:
    """One verification read pass over acknowledged, non-lost keys: ``hits`` of ``reads`` read
    a correct value; ``wrong`` read bytes that were not a value of their key."""

    t: float
    hit_rate: float
    reads: int = 0
    hits: int = 0
    wrong: int = 0


def _slots_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _master_state(probe: MasterProbe) -> MasterState:
    if probe.status is None:
        return MasterState(probe.address, error=probe.error or "no answer")
    m = probe.status.master
    return MasterState(
        address=probe.address,
        role=m.role,
        term=m.term,
        commit_index=m.commit_index,
        last_applied=m.last_applied,
        revision=m.revision,
        leader=m.leader_grpc_address,
    )


def masters_agree(states: Sequence[MasterState]) -> bool:
    """Every master answered, one leads, and all have the same commit index and revision."""
    if not states or not all(s.answered for s in states):
        return False
    if sum(s.role == "leader" for s in states) != 1:
        return False
    return len({(s.commit_index, s.revision) for s in states}) == 1


async def _settle(
    masters: Sequence[str],
    settle_timeout_s: float,
    rpc_timeout_s: float,
    clock: Callable[[], float],
) -> tuple[list[MasterProbe], float | None]:
    deadline = clock() + settle_timeout_s
    while True:
        probes = await probe_masters_async(masters, rpc_timeout_s)
        now = clock()
        if masters_agree([_master_state(p) for p in probes]):
            return probes, now
        if now >= deadline:
            return probes, None
        await asyncio.sleep(0.1)


async def _node_table(
    leader: MasterProbe | None, rpc_timeout_s: float
) -> tuple[list[NodeState], bool, int]:
    if leader is None or leader.status is None:
        return [], False, 0
    status = leader.status
    admin = [n.member.admin_address for n in status.nodes if n.member.admin_address]
    node_stats = {}
    for probe in await probe_nodes_async(admin, rpc_timeout_s) if admin else []:
        if probe.stats is not None:
            node_stats[probe.stats.member_id] = int(probe.stats.evictions_total)
    nodes = []
    for n in status.nodes:
        m = n.member
        known = [int(n.evictions_total)] if n.last_heartbeat_age_s >= 0 else []
        if m.member_id in node_stats:
            known.append(node_stats[m.member_id])
        nodes.append(
            NodeState(
                member_id=m.member_id,
                node_id=m.node_id,
                incarnation=m.incarnation,
                data_address=m.data_address,
                admin_address=m.admin_address,
                evictions_total=max(known) if known else None,
            )
        )
    return nodes, True, int(status.ring_version)


async def _lookup_all(
    masters: Sequence[str], leader: str | None, keys: Sequence[str], rpc_timeout_s: float
) -> tuple[dict[str, IndexEntry | None], list[str]]:
    client = MasterClient(masters, attempt_timeout_s=rpc_timeout_s, security=env_security())
    client.leader = leader
    entries: dict[str, IndexEntry | None] = {}
    unresolved: list[str] = []
    loop = asyncio.get_running_loop()
    try:
        for i in range(0, len(keys), LOOKUP_BATCH):
            batch = list(keys[i : i + LOOKUP_BATCH])
            request = master_pb2.LookupRequest(keys=batch, min_revision=0)
            try:
                response = await client.call(
                    "Lookup", request, deadline=loop.time() + 3 * rpc_timeout_s
                )
            except KVPoolError:
                unresolved.extend(batch)
                continue
            for key, e in zip(batch, response.entries, strict=True):
                entries[key] = (
                    IndexEntry(int(e.version), int(e.write_id), tuple(int(r) for r in e.replicas))
                    if e.found
                    else None
                )
    finally:
        await client.close()
    return entries, unresolved


async def collect_final_state_async(
    masters: Sequence[str],
    keys: Sequence[str],
    *,
    settle_timeout_s: float = 15.0,
    rpc_timeout_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> FinalState:
    """The final state (see the module doc). Never raises for an unreachable cluster: what no
    one answered is recorded as such, for the checkers to judge."""
    started_t = clock()
    probes, settled_t = await _settle(masters, settle_timeout_s, rpc_timeout_s, clock)
    leader = leader_of(probes)
    nodes, nodes_known, ring_version = await _node_table(leader, rpc_timeout_s)
    entries, unresolved = await _lookup_all(
        masters, leader.address if leader else None, keys, rpc_timeout_s
    )
    return FinalState(
        t=clock(),
        masters=[_master_state(p) for p in probes],
        leader=leader.address if leader else None,
        nodes=nodes,
        nodes_known=nodes_known,
        entries=entries,
        unresolved=unresolved,
        settled_t=settled_t,
        started_t=started_t,
        ring_version=ring_version,
    )


def collect_final_state(masters: Sequence[str], keys: Sequence[str], **kwargs: Any) -> FinalState:
    """:func:`collect_final_state_async` from synchronous code (not inside an event loop)."""
    return asyncio.run(collect_final_state_async(masters, keys, **kwargs))


# --- probes for the convergence checker ---------------------------------------------------------


async def sample_masters_async(
    masters: Mapping[str, str],
    *,
    rpc_timeout_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> CommitSample:
    """One CommitSample: each master's (by name → gRPC address) commit index and revision."""
    names = list(masters)
    probes = await probe_masters_async([masters[n] for n in names], rpc_timeout_s)
    t = clock()
    commit: dict[str, int | None] = {}
    revision: dict[str, int | None] = {}
    for name, probe in zip(names, probes, strict=True):
        status = probe.status
        commit[name] = int(status.master.commit_index) if status is not None else None
        revision[name] = int(status.master.revision) if status is not None else None
    return CommitSample(t, commit, revision)


def sample_masters(
    masters: Mapping[str, str],
    *,
    rpc_timeout_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> CommitSample:
    return asyncio.run(sample_masters_async(masters, rpc_timeout_s=rpc_timeout_s, clock=clock))


def sample_until_agreed(
    masters: Mapping[str, str],
    within_s: float,
    *,
    every_s: float = 0.25,
    rpc_timeout_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[CommitSample]:
    """CommitSamples every ``every_s`` until every master shows the same commit index and has
    applied it (the same revision), or ``within_s`` has passed: the evidence the convergence
    check wants. One sample is not enough: a follower one entry behind the leader at that
    instant is a healthy cluster mid-replication, not a failure to converge."""
    samples: list[CommitSample] = []
    deadline = clock() + within_s
    while True:
        sample = sample_masters(masters, rpc_timeout_s=rpc_timeout_s, clock=clock)
        samples.append(sample)
        # A follower can know the commit index before it has applied the entries, and the
        # convergence check asks for both.
        values = list(zip(sample.commit_index.values(), sample.revision.values(), strict=True))
        if values and all(None not in v for v in values) and len(set(values)) == 1:
            return samples
        if clock() >= deadline:
            return samples
        sleep(every_s)


async def live_member_ids_async(
    masters: Sequence[str], *, rpc_timeout_s: float = 1.0
) -> set[int] | None:
    """The member ids the leader knows as live now (None: no leader answered): what
    :meth:`~kvpool.chaos.history.History.acknowledged_keys` takes to leave out keys lost with
    their nodes."""
    leader = leader_of(await probe_masters_async(masters, rpc_timeout_s))
    if leader is None or leader.status is None:
        return None
    return {int(n.member.member_id) for n in leader.status.nodes}


def live_member_ids(masters: Sequence[str], *, rpc_timeout_s: float = 1.0) -> set[int] | None:
    return asyncio.run(live_member_ids_async(masters, rpc_timeout_s=rpc_timeout_s))


def verify_reads(
    client: Any, keys: Sequence[str], *, clock: Callable[[], float] = time.monotonic
) -> HitRateSample:
    """Read ``keys`` with a (non-strict) ``kvpool.Client``'s batch_get and count the reads that
    returned a correct value of their key. Misses lower the hit rate; bytes that are not a
    value of their key count as ``wrong``. An empty key list is a hit rate of 1."""
    hits = wrong = 0
    for i in range(0, len(keys), LOOKUP_BATCH):
        batch = list(keys[i : i + LOOKUP_BATCH])
        for key, data in zip(batch, client.batch_get(batch), strict=True):
            if data is None:
                continue
            if isinstance(decode_value(key, data), ValueId):
                hits += 1
            else:
                wrong += 1
    reads = len(keys)
    return HitRateSample(clock(), hits / reads if reads else 1.0, reads, hits, wrong)
