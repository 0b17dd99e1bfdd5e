"""Faults as named, seeded, reproducible steps.

Pure part: a :class:`Fault` says *what* (its kind and parameters) and *to whom* (a target
selector); :func:`choose_target` turns a selector into concrete process names from a
:class:`ClusterView` and a seeded ``random.Random``. Given the same view and rng state it picks
the same targets, and it always draws the same amount from the rng (one 64-bit number), whatever
the view, so one choice never shifts the next: a schedule is a pure function of (scenario,
seed).

Selectors:

- ``leader``, ``follower``, ``any-master``, ``node``, ``any``: one running, unpaused process of
  that role (``follower``: a master that is not the leader; with no leader known, any master).
- ``master-minority``: floor((n-1)/2) of the n masters, chosen among the running, unpaused masters
  that are **not the leader** — the majority side keeps the leader and its quorum, so a split
  tests that a cut-off minority rejoins without disturbing the cluster. (The leader on the
  minority side is the ``isolate`` fault with selector ``leader``.) No target with fewer than
  3 masters.
- ``all-masters``, ``all-nodes``: every running, unpaused process of that role.

Shell part: :class:`Nemesis` injects a fault into a harness (anything shaped like
:class:`FaultTarget`; :class:`kvpool.chaos.harness.ChaosHarness` is) and heals it, recording a
:class:`FaultEvent` for each step with monotonic and wall timestamps, the concrete targets
(process names and store node ids) and the outcome. It blocks (kills wait for the process to
die, restarts for it to be ready): an asyncio runner calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvpool.chaos.netns import CLIENTS
from kvpool.chaos.proxy import LinkBehaviour
from kvpool.errors import KVPoolError
from kvpool.logs import get_logger

SINGLE_SELECTORS = ("leader", "follower", "any-master", "node", "any")
SELECTORS = (*SINGLE_SELECTORS, "master-minority", "all-masters", "all-nodes")
_LINK_PARAMS = tuple(LinkBehaviour().to_dict())
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (selectors it accepts, parameters it accepts)
    "kill": (SINGLE_SELECTORS, ()),
    "pause": (SINGLE_SELECTORS, ()),
    "isolate": (SINGLE_SELECTORS, ("from",)),
    "split": (("master-minority",), ()),
    "link": (
        ("leader", "follower", "any-master", "all-masters", "node", "all-nodes"),
        _LINK_PARAMS,
    ),
    "clock": (SINGLE_SELECTORS, ("offset_s",)),
    "rolling-restart": (("all-masters",), ("catch_up_timeout_s",)),
    "drain": (("node",), ("timeout_s",)),
}
ISOLATE_FROM = ("masters", "nodes", "clients", "all")
HEALABLE = frozenset({"kill", "pause", "isolate", "split", "link", "clock", "drain"})


class NemesisError(KVPoolError):
    """A fault is malformed, or cannot be injected or healed."""

    code = "CHAOS_NEMESIS"


class NoTargetError(NemesisError):
    """No process matches the fault's target selector right now."""

    code = "CHAOS_NO_TARGET"


def fault_name(kind: str, target: str, params: Mapping[str, Any] | None = None) -> str:
    """The default name of a fault: ``kill-leader``, ``link-node(delay_ms=200)``."""
    name = f"{kind}-{target}"
    if params:
        name += "(" + ",".join(f"{k}={params[k]}" for k in sorted(params)) + ")"
    return name


@dataclass(frozen=True, eq=True)
class Fault:
    """One fault: ``kind`` done to the processes ``target`` selects, with ``params``."""

    name: str
    kind: str
    target: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise NemesisError(f"unknown fault kind {self.kind!r} (known: {', '.join(KINDS)})")
        selectors, allowed = KINDS[self.kind]
        if self.target not in selectors:
            raise NemesisError(
                f"fault kind {self.kind} cannot target {self.target!r} "
                f"(it takes: {', '.join(selectors)})"
            )
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            raise NemesisError(f"fault kind {self.kind} takes no parameter {', '.join(unknown)}")
        if self.kind == "isolate" and self.params.get("from", "masters") not in ISOLATE_FROM:
            raise NemesisError(f"isolate: 'from' must be one of {', '.join(ISOLATE_FROM)}")
        if self.kind == "clock":
            offset = self.params.get("offset_s")
            if not isinstance(offset, int | float) or isinstance(offset, bool) or offset == 0:
                raise NemesisError("clock: needs a non-zero number offset_s")
        if self.kind == "link":
            LinkBehaviour.from_dict(dict(self.params))  # raises on a bad value
        if not self.name:
            object.__setattr__(self, "name", fault_name(self.kind, self.target, self.params))

    @classmethod
    def make(cls, kind: str, target: str, name: str = "", **params: Any) -> Fault:
        return cls(name=name, kind=kind, target=target, params=params)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "target": self.target, **self.params}


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault.make("kill", "leader", "kill-leader"),
        Fault.make("kill", "follower", "kill-follower"),
        Fault.make("kill", "node", "kill-node"),
        Fault.make("pause", "leader", "pause-leader"),
        Fault.make("pause", "node", "pause-node"),
        Fault.make("isolate", "leader", "isolate-leader", **{"from": "masters"}),
        Fault.make("split", "master-minority", "split-masters"),
        Fault.make("isolate", "node", "cut-node-from-masters", **{"from": "masters"}),
        Fault.make("isolate", "node", "cut-node-from-clients", **{"from": "clients"}),
        Fault.make("link", "node", "slow-node-link", delay_ms=200, jitter_ms=50),
        Fault.make("link", "node", "lossy-node-link", reset_probability=0.05),
        Fault.make("link", "node", "corrupt-node-link", corrupt_probability=0.2),
        Fault.make("link", "node", "stall-node-link", stall=True),
        Fault.make("link", "all-masters", "slow-master-link", delay_ms=100, jitter_ms=20),
        Fault.make("clock", "any", "clock-forward", offset_s=3600),
        Fault.make("clock", "any", "clock-back", offset_s=-3600),
        Fault.make("rolling-restart", "all-masters", "rolling-restart"),
        Fault.make("drain", "node", "drain-node", timeout_s=20.0),
    )
}
"""The named faults scenarios are built from."""


@dataclass(frozen=True)
class ClusterView:
    """Who is who, as seen just before a fault: names of every master and node, the leader
    (None when none is known), and which are down (killed, stopped) or paused."""

    masters: tuple[str, ...]
    nodes: tuple[str, ...]
    leader: str | None = None
    down: frozenset[str] = frozenset()
    paused: frozenset[str] = frozenset()

    def up(self, names: Sequence[str]) -> list[str]:
        return sorted(n for n in names if n not in self.down and n not in self.paused)


def choose_target(selector: str, view: ClusterView, rng: random.Random) -> tuple[str, ...]:
    """The processes ``selector`` picks from ``view``, drawn with ``rng`` (exactly one 64-bit
    draw per call, whatever the outcome). Raises NoTargetError when none qualifies."""
    pick = random.Random(rng.getrandbits(64))
    masters = view.up(view.masters)
    nodes = view.up(view.nodes)
    leader = view.leader if view.leader in masters else None
    if selector == "leader":
        candidates = [leader] if leader else []
    elif selector == "follower":
        candidates = [m for m in masters if m != view.leader]
    elif selector == "any-master":
        candidates = masters
    elif selector == "node":
        candidates = nodes
    elif selector == "any":
        candidates = sorted([*masters, *nodes])
    elif selector == "all-masters":
        if not masters:
            raise NoTargetError("all-masters: no master is up")
        return tuple(masters)
    elif selector == "all-nodes":
        if not nodes:
            raise NoTargetError("all-nodes: no node is up")
        return tuple(nodes)
    elif selector == "master-minority":
        size = (len(view.masters) - 1) // 2
        eligible = [m for m in masters if m != view.leader]
        if size < 1 or len(eligible) < size:
            raise NoTargetError(
                f"master-minority: need {max(size, 1)} running non-leader masters of "
                f"{len(view.masters)}, have {len(eligible)}"
            )
        return tuple(sorted(pick.sample(eligible, size)))
    else:
        raise NemesisError(f"unknown target selector {selector!r}")
    if not candidates:
        raise NoTargetError(f"{selector}: no running, unpaused process qualifies")
    return (candidates[pick.randrange(len(candidates))],)


@dataclass(frozen=True)
class FaultEvent:
    """One step of a nemesis: a fault injected or healed, when, to whom, with what result."""

    seq: int
    phase: str  # "inject" | "heal"
    fault: str
    kind: str
    selector: str
    targets: tuple[str, ...]
    node_ids: tuple[str, ...]  # store node ids among the targets
    monotonic_s: float  # time.monotonic() when the step began
    wall_s: float  # time.time() when the step began, for humans
    duration_s: float
    outcome: str  # "ok" | "skipped" | "failed"
    reason: str = ""
    heals: int | None = None  # a heal step: the seq of the inject step it undoes
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["targets"] = list(self.targets)
        doc["node_ids"] = list(self.node_ids)
        doc["details"] = dict(self.details)
        return doc


class FaultTarget(Protocol):
    """What a nemesis needs of a harness (ChaosHarness has it)."""

    @property
    def partitions_supported(self) -> bool: ...
    @property
    def skip_reason(self) -> str: ...
    @property
    def links_supported(self) -> bool: ...
    @property
    def clocks_supported(self) -> bool: ...
    @property
    def master_names(self) -> list[str]: ...
    @property
    def node_names(self) -> list[str]: ...
    def view(self) -> ClusterView: ...
    def node_id_of(self, name: str) -> str: ...
    def kill(self, name: str) -> None: ...
    def restart(self, name: str) -> None: ...
    def terminate(self, name: str) -> None: ...
    def pause(self, name: str) -> None: ...
    def resume(self, name: str) -> None: ...
    def wait_caught_up(self, timeout_s: float) -> bool: ...
    def drain(self, name: str, timeout_s: float) -> int: ...
    def cut(self, pairs: Sequence[tuple[str, str]]) -> None: ...
    def uncut(self, pairs: Sequence[tuple[str, str]]) -> None: ...
    def set_link(self, name: str, behaviour: LinkBehaviour) -> None: ...
    def jump_clock(self, name: str, offset_s: float) -> None: ...


@dataclass(frozen=True)
class _Step:
    seq: int
    phase: str
    name: str
    kind: str
    selector: str
    monotonic_s: float
    wall_s: float


class Nemesis:
    """Injects and heals faults on a harness, recording every step."""

    def __init__(
        self,
        harness: FaultTarget,
        rng: random.Random,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.harness = harness
        self.rng = rng
        self._monotonic = monotonic
        self._wall = wall
        self._seq = itertools.count(1)
        self.events: list[FaultEvent] = []
        self.active: dict[int, FaultEvent] = {}
        """Injected and not yet healed, by seq."""
        self.log = get_logger("kvpool.chaos.nemesis")

    # --- inject ----------------------------------------------------------------------------

    def inject(self, fault: Fault) -> FaultEvent:
        step = self._begin("inject", fault.name, fault.kind, fault.target)
        view = self.harness.view()
        try:
            targets = choose_target(fault.target, view, self.rng)
        except NoTargetError as e:
            return self._record(step, (), "skipped", e.message)
        unsupported = self._unsupported(fault.kind)
        if unsupported:
            return self._record(step, targets, "skipped", unsupported)
        details: dict[str, Any] = {"leader_before": view.leader}
        try:
            outcome, reason = self._do_inject(fault, targets, view, details)
        except (KVPoolError, OSError) as e:
            outcome, reason = "failed", f"{type(e).__name__}: {e}"
        event = self._record(step, targets, outcome, reason, details=details)
        if fault.kind in HEALABLE and outcome != "skipped":
            self.active[event.seq] = event  # a failed inject may have half-happened: heal it
        return event

    def _unsupported(self, kind: str) -> str:
        h = self.harness
        if kind in ("isolate", "split") and not h.partitions_supported:
            return h.skip_reason or "partitions are not supported here"
        if kind == "link" and not h.links_supported:
            return "the harness runs without link proxies (proxies=True turns them on)"
        if kind == "clock" and not h.clocks_supported:
            return "the harness runs without fake clocks (fake_clocks=True turns them on)"
        return ""

    def _do_inject(
        self, fault: Fault, targets: tuple[str, ...], view: ClusterView, details: dict[str, Any]
    ) -> tuple[str, str]:
        h = self.harness
        kind = fault.kind
        if kind == "kill":
            for t in targets:
                h.kill(t)
        elif kind == "pause":
            for t in targets:
                h.pause(t)
        elif kind in ("isolate", "split"):
            pairs = self._partition_pairs(fault, targets)
            details["pairs"] = [list(p) for p in pairs]
            h.cut(pairs)
        elif kind == "link":
            behaviour = LinkBehaviour.from_dict(dict(fault.params))
            details["behaviour"] = behaviour.to_dict()
            for t in targets:
                h.set_link(t, behaviour)
        elif kind == "clock":
            offset_s = float(fault.params["offset_s"])
            details["offset_s"] = offset_s
            for t in targets:
                h.jump_clock(t, offset_s)
        elif kind == "rolling-restart":
            return self._rolling_restart(fault, targets, view, details)
        elif kind == "drain":
            # hand the node's blocks to others, then stop it (SIGTERM); the heal restarts it
            timeout_s = float(fault.params.get("timeout_s", 20.0))
            for t in targets:
                left = h.drain(t, timeout_s)
                details["blocks_left"] = left
                h.terminate(t)
                if left:
                    return "failed", f"{t}: {left} blocks not handed over within {timeout_s} s"
        return "ok", ""

    def _partition_pairs(self, fault: Fault, targets: tuple[str, ...]) -> list[tuple[str, str]]:
        masters, nodes = self.harness.master_names, self.harness.node_names
        if fault.kind == "split":
            majority = [m for m in masters if m not in targets]
            return [(a, b) for a in targets for b in majority]
        group = fault.params.get("from", "masters")
        others = {
            "masters": masters,
            "nodes": nodes,
            "clients": [CLIENTS],
            "all": [*masters, *nodes, CLIENTS],
        }[group]
        return [(t, o) for t in targets for o in others if o != t]

    def _rolling_restart(
        self, fault: Fault, targets: tuple[str, ...], view: ClusterView, details: dict[str, Any]
    ) -> tuple[str, str]:
        """SIGTERM, restart and wait for each master to catch up, followers first."""
        timeout_s = float(fault.params.get("catch_up_timeout_s", 30.0))
        order = sorted(targets, key=lambda m: (m == view.leader, m))
        steps: list[dict[str, Any]] = []
        details["steps"] = steps
        for master in order:
            began = self._monotonic()
            self.harness.terminate(master)
            self.harness.restart(master)
            caught_up = self.harness.wait_caught_up(timeout_s)
            steps.append(
                {
                    "master": master,
                    "caught_up": caught_up,
                    "elapsed_s": round(self._monotonic() - began, 3),
                }
            )
            if not caught_up:
                return "failed", f"{master} did not catch up within {timeout_s} s of its restart"
        return "ok", ""

    # --- heal ------------------------------------------------------------------------------

    def heal(self, event: FaultEvent) -> FaultEvent:
        """Undo an injected fault: restart what was killed, resume what was paused, remove the
        partition rules it added, put the link or clock back."""
        step = self._begin("heal", event.fault, event.kind, event.selector)
        if self.active.pop(event.seq, None) is None:
            reason = f"step {event.seq} is not an active fault"
            return self._record(step, event.targets, "skipped", reason, heals=event.seq)
        details: dict[str, Any] = {}
        try:
            self._do_heal(event, details)
            outcome, reason = "ok", ""
        except (KVPoolError, OSError) as e:
            outcome, reason = "failed", f"{type(e).__name__}: {e}"
        return self._record(step, event.targets, outcome, reason, heals=event.seq, details=details)

    def _do_heal(self, event: FaultEvent, details: dict[str, Any]) -> None:
        h = self.harness
        view = h.view()
        if event.kind in ("kill", "drain"):
            for t in event.targets:
                if t in view.down:
                    h.restart(t)
        elif event.kind == "pause":
            for t in event.targets:
                h.resume(t)
        elif event.kind in ("isolate", "split"):
            pairs = [(str(a), str(b)) for a, b in event.details.get("pairs", [])]
            h.uncut(pairs)
        elif event.kind == "link":
            for t in event.targets:
                h.set_link(t, LinkBehaviour())
        elif event.kind == "clock":
            for t in event.targets:
                h.jump_clock(t, 0.0)
        details["leader_after"] = (
            h.view().leader if event.kind in ("kill", "pause", "drain") else None
        )

    def heal_all(self) -> list[FaultEvent]:
        """Heal every active fault, the latest first."""
        return [self.heal(self.active[seq]) for seq in sorted(self.active, reverse=True)]

    # --- records ---------------------------------------------------------------------------

    def _begin(self, phase: str, name: str, kind: str, selector: str) -> _Step:
        return _Step(next(self._seq), phase, name, kind, selector, self._monotonic(), self._wall())

    def _record(
        self,
        step: _Step,
        targets: tuple[str, ...],
        outcome: str,
        reason: str = "",
        *,
        heals: int | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> FaultEvent:
        nodes = set(self.harness.node_names)
        event = FaultEvent(
            seq=step.seq,
            phase=step.phase,
            fault=step.name,
            kind=step.kind,
            selector=step.selector,
            targets=targets,
            node_ids=tuple(self.harness.node_id_of(t) for t in targets if t in nodes),
            monotonic_s=step.monotonic_s,
            wall_s=step.wall_s,
            duration_s=max(0.0, self._monotonic() - step.monotonic_s),
            outcome=outcome,
            reason=reason,
            heals=heals,
            details=dict(details or {}),
        )
        self.events.append(event)
        verb = {"inject": "injected", "heal": "healed"}[step.phase] if outcome == "ok" else outcome
        self.log.info(
            f"fault_{verb}",
            seq=step.seq,
            phase=step.phase,
            fault=step.name,
            targets=list(targets),
            reason=reason or None,
            duration_s=round(event.duration_s, 3),
        )
        return event
