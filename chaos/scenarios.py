"""Named chaos scenarios: which faults, on what schedule, under which workload.

A scenario is data. Its schedule is a pure function of (scenario, duration, seed): a quiet
warm-up, then cycles of *inject → hold → heal → recover* until the last fifth of the run, which
is quiet again so the cluster can settle before the final checks. The same seed gives the same
fault names at the same offsets; which concrete process each fault hits is chosen by the
nemesis from the same seed when the fault is injected.

Scenarios whose faults need something this machine lacks (network namespaces need root;
partitions need nftables) still run: the nemesis records those faults as skipped, with the
reason, and the checkers still judge the workload.

Regression scenarios (``regress-*``) replay, with their seed, a bug the suite once found; the
ledger in README.md says which.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.chaos.nemesis import FAULTS

WARMUP_FRACTION = 0.12
QUIET_TAIL_FRACTION = 0.2


@dataclass(frozen=True)
class Step:
    """Inject ``fault`` at ``at_s`` seconds into the run; heal it ``hold_s`` later."""

    at_s: float
    fault: str
    hold_s: float


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: tuple[str, ...]  # the pool each cycle draws from (one fault: always that one)
    hold_s: float = 3.0  # how long a fault stays before it is healed
    recover_s: float = 2.0  # quiet time after a heal before the next fault
    catches: str = ""  # the behaviour or bug this scenario is there to catch
    proxies: bool = False  # put link proxies on the client paths
    fake_clocks: bool = False  # start processes with a fake wall clock (clock faults)
    node_timeout_s: float = 2.0
    extra_master_flags: tuple[str, ...] = ()
    extra_node_flags: tuple[str, ...] = ()  # {name} and {dir}: the node's name, cluster dir
    cpu_cache_size: str = "256MiB"
    workload_args: tuple[str, ...] = ()  # more flags for python -m kvpool.chaos.workload
    hit_rate_target: float = 0.9  # convergence: verification reads that must hit after healing
    timeout_s: float = 1.0  # the workload's per-call client timeout
    processes: int = 3
    keys: int = 48
    mix: str = ""
    default_seed: int = 1
    min_duration_s: float = 8.0
    nodes: int = 2
    replica_target: int = 0  # checker `replicas`: live replicas every indexed key ends with
    content_keys: bool = False  # keys that name their content (read with no Lookup first)

    def schedule(self, duration_s: float, seed: int) -> list[Step]:
        """The faults of a run of ``duration_s`` seconds, as a pure function of the seed."""
        rng = random.Random(f"{self.name}/{seed}")
        start = max(1.0, duration_s * WARMUP_FRACTION)
        end = duration_s * (1 - QUIET_TAIL_FRACTION)
        steps: list[Step] = []
        t = start
        while t + self.hold_s <= end or not steps:
            fault = self.faults[0] if len(self.faults) == 1 else rng.choice(self.faults)
            hold = self.hold_s * rng.uniform(0.8, 1.2)
            steps.append(Step(round(t, 3), fault, round(hold, 3)))
            t += hold + self.recover_s * rng.uniform(0.8, 1.2)
        return steps

    @property
    def needs(self) -> frozenset[str]:
        kinds = {FAULTS[f].kind for f in self.faults}
        needs = set()
        if kinds & {"isolate", "split"}:
            needs.add("partitions")
        if "link" in kinds:
            needs.add("links")
        if "clock" in kinds:
            needs.add("clocks")
        return frozenset(needs)


def _scenarios(items: Sequence[Scenario]) -> dict[str, Scenario]:
    out: dict[str, Scenario] = {}
    for s in items:
        if s.name in out:
            raise ValueError(f"scenario {s.name!r} defined twice")
        unknown = [f for f in s.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"scenario {s.name!r} names unknown faults {unknown}")
        out[s.name] = s
    return out


_HOT_FLAGS = ("--hot-reads-per-s", "5", "--hot-half-life-s", "2s", "--hot-max-replicas", "3")
_EVERYTHING = tuple(f for f in FAULTS if f != "drain-node")  # drains: their own scenario

SCENARIOS: dict[str, Scenario] = _scenarios(
    [
        Scenario(
            "leader-kill",
            "kill -9 the Raft leader under load, restart it after a while",
            ("kill-leader",),
            catches="lost commits on failover; late-applied LEADER_CHANGED commands applied twice",
        ),
        Scenario(
            "follower-kill",
            "kill -9 a follower master, restart it; it must catch up within seconds",
            ("kill-follower",),
            catches="a restarted follower that never catches up",
        ),
        Scenario(
            "node-kill",
            "kill -9 a store node, restart it with a new incarnation",
            ("kill-node",),
            hold_s=3.0,
            catches="reads of a dead node that hang instead of missing; blocks of an old "
            "incarnation served again",
        ),
        Scenario(
            "leader-pause",
            "SIGSTOP the leader past an election, then SIGCONT it (a gray failure: a deposed "
            "leader that wakes up believing it leads)",
            ("pause-leader",),
            catches="stale reads from a deposed leader (they may only miss)",
        ),
        Scenario(
            "node-pause",
            "SIGSTOP a store node past its heartbeat timeout, then SIGCONT it",
            ("pause-node",),
            hold_s=3.5,
            catches="a node declared down that keeps serving its old blocks as if indexed",
        ),
        Scenario(
            "leader-isolated",
            "cut the leader from the other masters (it keeps clients and nodes), then heal",
            ("isolate-leader",),
            hold_s=4.0,
            catches="an isolated leader believing it leads (leaderFallbackTimeout); a rejoining "
            "leader with a divergent uncommitted suffix stuck as a follower",
        ),
        Scenario(
            "master-minority-partition",
            "split the masters: a minority cut from the majority, then heal",
            ("split-masters",),
            hold_s=4.0,
            catches="a minority that serves writes; a minority that cannot rejoin",
        ),
        Scenario(
            "node-cut-from-masters",
            "cut a store node from the masters but not from clients, then heal",
            ("cut-node-from-masters",),
            hold_s=3.5,
            catches="a node declared down whose blocks are still read through a stale index",
        ),
        Scenario(
            "node-cut-from-clients",
            "cut a store node from clients but not from the masters, then heal",
            ("cut-node-from-clients",),
            hold_s=3.5,
            catches="reads that hang on a silent node; pooled connections that stay dead",
        ),
        Scenario(
            "slow-link",
            "delay the clients' links to a node and to the masters",
            ("slow-node-link", "slow-master-link"),
            hold_s=3.0,
            proxies=True,
            catches="calls outliving their deadline on a slow network",
        ),
        Scenario(
            "lossy-link",
            "reset, stall and corrupt the clients' link to a node",
            ("lossy-node-link", "corrupt-node-link", "stall-node-link"),
            hold_s=3.0,
            proxies=True,
            catches="corrupted bytes read as data; a stalled connection kept in the pool",
        ),
        Scenario(
            "clock-jump",
            "jump one process's wall clock an hour forward or back (no decision compares "
            "clocks across machines, so nothing may change)",
            ("clock-forward", "clock-back"),
            hold_s=3.0,
            fake_clocks=True,
            catches="decisions taken on wall-clock time",
        ),
        Scenario(
            "rolling-restart",
            "restart every master one by one, waiting for each to catch up",
            ("rolling-restart",),
            hold_s=0.5,
            recover_s=3.0,
            catches="lost commits or stuck writes across a rolling upgrade",
        ),
        Scenario(
            "late-commit",
            "delay client→master traffic past the client's per-attempt timeout: commits time "
            "out at the client but apply on the masters, and retries reuse their request ids",
            ("slow-master-link",),
            hold_s=4.0,
            proxies=True,
            timeout_s=2.5,
            catches="timed-out commands applied later, and applied twice on retry",
        ),
        Scenario(
            "compaction-stall",
            "compact the Raft log every few hundred entries under load while killing leaders",
            ("kill-leader", "kill-follower"),
            extra_master_flags=("--raft-compaction-min-entries", "200"),
            catches="log compaction stalling the Raft thread into elections; snapshots sent to "
            "followers",
        ),
        Scenario(
            "node-kill-full-ssd",
            "kill -9 a store node whose small CPU tier has spilled into a full SSD tier, then "
            "restart it: it finds its SSD blocks again, checks them and claims them back",
            ("kill-node",),
            hold_s=3.0,
            recover_s=4.0,
            cpu_cache_size="16MiB",
            extra_node_flags=(
                "--ssd-cache-path",
                "{dir}/{name}-ssd",
                "--ssd-cache-size",
                "32MiB",
                "--ssd-segment-size",
                "4MiB",
                "--max-block-size",
                "1MiB",
            ),
            keys=400,  # ~85 MiB of distinct values: a bit more than CPU + SSD of both nodes
            workload_args=("--size-min", "64KiB", "--size-max", "512KiB"),
            # Capacity-bound by design (the SSD must be full when the node dies): evicted keys
            # are misses, so the hit rate after healing cannot reach 90 %.
            hit_rate_target=0.4,
            catches="SSD blocks served wrong or lost after a kill; a warm restart that claims "
            "blocks the index no longer names; demotion racing a kill",
        ),
        Scenario(
            "node-kill-hot-load",
            "kill -9 a store node of three under a read-heavy load on few keys, written with "
            "2 replicas and raised to 3 while hot; restart it. Reads of a hot key must keep "
            "hitting, and every key must end with at least its 2 replicas (repair)",
            ("kill-node",),
            hold_s=3.0,
            recover_s=3.0,
            nodes=3,
            keys=24,
            mix="put=1,get=12,batch=2",
            workload_args=("--replicas", "2", "--size-max", "64KiB"),
            extra_master_flags=_HOT_FLAGS,
            replica_target=2,
            catches="reads of a hot block that miss when one holder dies; blocks left under "
            "their replica count after a node loss (no repair, or repair from a dead source)",
        ),
        Scenario(
            "node-drain",
            "drain a store node of three under load (its blocks handed to the others), stop "
            "it, restart it empty; nothing acknowledged may be lost",
            ("drain-node",),
            hold_s=2.0,
            recover_s=3.0,
            nodes=3,
            workload_args=("--replicas", "1", "--size-max", "64KiB"),
            replica_target=1,
            catches="blocks lost by a drain (released before their copy was indexed); a "
            "drained node still named by the index",
        ),
        Scenario(
            "content-keys",
            "keys that name their content, read straight from the node the ring places them "
            "on: store nodes killed and restarted, paused, cut from the clients, the leader "
            "killed, under writes, reads and removes",
            ("kill-node", "pause-node", "cut-node-from-clients", "kill-leader"),
            proxies=True,
            hold_s=3.0,
            recover_s=3.0,
            content_keys=True,
            workload_args=("--size-max", "256KiB"),
            catches="a read by content served a block of another key, a damaged block or one "
            "never committed; a block acknowledged then missed by a reader during faults",
        ),
        Scenario(
            "random-mix",
            "a seeded random fault from the whole catalogue in every cycle",
            _EVERYTHING,
            proxies=True,
            fake_clocks=True,
            hold_s=3.0,
            catches="interactions between faults",
        ),
        Scenario(
            "regress-pooled-connection-after-partition",
            "regression (found by the harness): a data connection silenced by a partition "
            "stayed pooled after its requests timed out, so every read on it missed for ~2 min",
            ("cut-node-from-clients",),
            hold_s=4.0,
            recover_s=3.0,
            default_seed=20261129,
            catches="pooled connections that stay dead after a partition heals",
        ),
        Scenario(
            "regress-desync-after-corruption",
            "regression (found by the harness): a request header garbled on the link left the "
            "node waiting for bytes that never came, and the client kept the connection",
            ("corrupt-node-link",),
            hold_s=3.0,
            recover_s=3.0,
            proxies=True,
            default_seed=20261129,
            catches="a desynchronised connection kept in the pool",
        ),
    ]
)
"""Every scenario, by name."""


@dataclass
class ScenarioListing:
    name: str
    faults: list[str]
    needs: list[str]
    description: str
    catches: str
    default_seed: int
    extra: dict[str, object] = field(default_factory=dict)


def listing() -> list[ScenarioListing]:
    return [
        ScenarioListing(
            s.name,
            list(s.faults),
            sorted(s.needs),
            s.description,
            s.catches,
            s.default_seed,
        )
        for s in SCENARIOS.values()
    ]
