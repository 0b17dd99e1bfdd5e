"""The pure parts of the chaos harness: fault definitions and names, seeded target choice, the
nemesis's bookkeeping (against a fake harness), link decisions, subnets and partition rules."""

from __future__ import annotations

import ipaddress
import json
import random
from collections.abc import Sequence

import pytest

from kvpool.chaos.clock import format_offset
from kvpool.chaos.nemesis import (
    FAULTS,
    ClusterView,
    Fault,
    Nemesis,
    NemesisError,
    NoTargetError,
    choose_target,
    fault_name,
)
from kvpool.chaos.netns import (
    CLIENTS,
    LoopbackNetwork,
    NamespaceNetwork,
    NetworkError,
    PartitionsUnsupportedError,
    bridge_name,
    namespace_name,
    partition_script,
    pick_subnet,
    veth_name,
)
from kvpool.chaos.proxy import ChunkFate, LinkBehaviour, LinkShaper, ProxyError
from kvpool.errors import UnavailableError

VIEW = ClusterView(
    masters=("master-1", "master-2", "master-3"),
    nodes=("node-1", "node-2"),
    leader="master-2",
)
VIEW5 = ClusterView(
    masters=tuple(f"master-{i}" for i in range(1, 6)),
    nodes=("node-1", "node-2", "node-3"),
    leader="master-4",
)

# --- faults and names ---------------------------------------------------------------------------


def test_fault_names_are_derived_from_kind_target_and_params() -> None:
    assert Fault.make("kill", "leader").name == "kill-leader"
    assert fault_name("link", "node", {"jitter_ms": 5, "delay_ms": 200}) == (
        "link-node(delay_ms=200,jitter_ms=5)"
    )
    assert Fault.make("clock", "any", offset_s=-3600).name == "clock-any(offset_s=-3600)"
    assert Fault.make("kill", "node", "my-name").name == "my-name"


def test_catalogue_names_are_unique_keys_and_every_fault_is_valid() -> None:
    assert len(FAULTS) >= 15
    for key, fault in FAULTS.items():
        assert key == fault.name
        Fault(fault.name, fault.kind, fault.target, dict(fault.params))  # validates again
        json.dumps(fault.to_json())
    for expected in (
        "kill-leader",
        "kill-follower",
        "kill-node",
        "pause-leader",
        "pause-node",
        "isolate-leader",
        "split-masters",
        "cut-node-from-masters",
        "cut-node-from-clients",
        "slow-node-link",
        "slow-master-link",
        "clock-forward",
        "clock-back",
        "rolling-restart",
    ):
        assert expected in FAULTS


@pytest.mark.parametrize(
    ("kind", "target", "params", "message"),
    [
        ("explode", "leader", {}, "unknown fault kind"),
        ("split", "leader", {}, "cannot target"),
        ("kill", "master-minority", {}, "cannot target"),
        ("kill", "leader", {"delay_ms": 3}, "no parameter"),
        ("clock", "any", {}, "offset_s"),
        ("clock", "any", {"offset_s": 0}, "offset_s"),
        ("isolate", "node", {"from": "moon"}, "'from'"),
        ("rolling-restart", "leader", {}, "cannot target"),
    ],
)
def test_malformed_faults_are_refused(
    kind: str, target: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(NemesisError, match=message):
        Fault("", kind, target, params)


def test_a_link_fault_with_a_bad_probability_is_refused() -> None:
    with pytest.raises(ProxyError, match="corrupt_probability"):
        Fault.make("link", "node", corrupt_probability=1.5)


# --- target choice ------------------------------------------------------------------------------


def test_the_same_seed_and_view_choose_the_same_targets() -> None:
    selectors = ["any", "node", "follower", "any-master", "master-minority", "leader"] * 20
    for seed in range(5):
        a, b = random.Random(seed), random.Random(seed)
        picks_a = [choose_target(s, VIEW5, a) for s in selectors]
        picks_b = [choose_target(s, VIEW5, b) for s in selectors]
        assert picks_a == picks_b


def test_different_seeds_choose_differently() -> None:
    sequences = {
        tuple(choose_target("any", VIEW5, rng) for _ in range(30))
        for rng in (random.Random(s) for s in range(10))
    }
    assert len(sequences) == 10
    # and every candidate is reachable
    rng = random.Random(1)
    assert {choose_target("any", VIEW5, rng)[0] for _ in range(400)} == {
        *VIEW5.masters,
        *VIEW5.nodes,
    }


def test_every_choice_draws_the_same_amount_from_the_rng_whatever_the_view() -> None:
    """A choice that fails, or that has more candidates, does not shift the choices after it:
    a schedule replays even when the cluster looked different at one step."""
    a, b = random.Random(42), random.Random(42)
    choose_target("any", VIEW5, a)
    with pytest.raises(NoTargetError):
        choose_target("leader", ClusterView(masters=("m",), nodes=(), leader=None), b)
    assert a.random() == b.random()
    choose_target("master-minority", VIEW5, a)
    choose_target("node", VIEW, b)
    assert a.getrandbits(64) == b.getrandbits(64)


def test_master_minority_is_a_minority_of_followers_never_the_leader() -> None:
    for seed in range(200):
        rng = random.Random(seed)
        three = choose_target("master-minority", VIEW, rng)
        assert len(three) == 1
        assert three[0] != VIEW.leader
        five = choose_target("master-minority", VIEW5, rng)
        assert len(five) == 2
        assert VIEW5.leader not in five
        assert list(five) == sorted(five)


def test_master_minority_needs_enough_running_followers() -> None:
    rng = random.Random(0)
    with pytest.raises(NoTargetError):
        choose_target("master-minority", ClusterView(("m1", "m2"), (), "m1"), rng)
    five_two_down = ClusterView(
        VIEW5.masters, VIEW5.nodes, "master-4", down=frozenset({"master-1", "master-2"})
    )
    pick = choose_target("master-minority", five_two_down, rng)
    assert set(pick) <= {"master-3", "master-5"}
    assert len(pick) == 2
    four_down = ClusterView(
        VIEW5.masters, (), "master-4", down=frozenset({"master-1", "master-2", "master-3"})
    )
    with pytest.raises(NoTargetError):
        choose_target("master-minority", four_down, rng)


def test_down_and_paused_processes_are_never_chosen() -> None:
    view = ClusterView(
        VIEW.masters,
        VIEW.nodes,
        leader="master-2",
        down=frozenset({"master-1", "node-1"}),
        paused=frozenset({"master-2"}),
    )
    rng = random.Random(3)
    for _ in range(50):
        assert choose_target("any", view, rng)[0] in {"master-3", "node-2"}
        assert choose_target("node", view, rng) == ("node-2",)
        assert choose_target("follower", view, rng) == ("master-3",)
    with pytest.raises(NoTargetError):
        choose_target("leader", view, rng)  # the leader is paused
    assert choose_target("all-masters", view, rng) == ("master-3",)


def test_follower_is_never_the_leader_and_leader_is_the_leader() -> None:
    rng = random.Random(9)
    for _ in range(100):
        assert choose_target("follower", VIEW, rng)[0] in {"master-1", "master-3"}
        assert choose_target("leader", VIEW, rng) == ("master-2",)
    no_leader = ClusterView(VIEW.masters, VIEW.nodes, leader=None)
    with pytest.raises(NoTargetError):
        choose_target("leader", no_leader, rng)
    assert choose_target("follower", no_leader, rng)[0] in VIEW.masters


# --- the nemesis against a fake harness ---------------------------------------------------------


class FakeHarness:
    def __init__(
        self, view: ClusterView = VIEW, *, partitions: bool = True, links: bool = True
    ) -> None:
        self._view = view
        self.calls: list[tuple[str, ...]] = []
        self.partitions = partitions
        self.links = links
        self.fail_on: str = ""

    @property
    def partitions_supported(self) -> bool:
        return self.partitions

    @property
    def skip_reason(self) -> str:
        return "" if self.partitions else "no namespaces here"

    @property
    def links_supported(self) -> bool:
        return self.links

    @property
    def clocks_supported(self) -> bool:
        return True

    @property
    def master_names(self) -> list[str]:
        return list(self._view.masters)

    @property
    def node_names(self) -> list[str]:
        return list(self._view.nodes)

    def view(self) -> ClusterView:
        return self._view

    def last(self) -> tuple[str, ...]:
        return self.calls[-1]

    def node_id_of(self, name: str) -> str:
        return f"id-{name}"

    def _call(self, *call: str) -> None:
        if call[0] == self.fail_on:
            raise UnavailableError(f"{call[0]} failed")
        self.calls.append(call)

    def kill(self, name: str) -> None:
        self._call("kill", name)
        self._view = ClusterView(
            self._view.masters,
            self._view.nodes,
            None if name == self._view.leader else self._view.leader,
            down=self._view.down | {name},
        )

    def restart(self, name: str) -> None:
        self._call("restart", name)
        self._view = ClusterView(
            self._view.masters, self._view.nodes, self._view.leader, self._view.down - {name}
        )

    def terminate(self, name: str) -> None:
        self._call("terminate", name)

    def pause(self, name: str) -> None:
        self._call("pause", name)

    def resume(self, name: str) -> None:
        self._call("resume", name)

    def wait_caught_up(self, timeout_s: float) -> bool:
        self._call("wait_caught_up")
        return True

    def drain(self, name: str, timeout_s: float) -> int:
        self._call("drain", name)
        return 0

    def cut(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._call("cut", *(f"{a}|{b}" for a, b in pairs))

    def uncut(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._call("uncut", *(f"{a}|{b}" for a, b in pairs))

    def set_link(self, name: str, behaviour: LinkBehaviour) -> None:
        self._call("link", name, json.dumps(behaviour.to_dict(), sort_keys=True))

    def jump_clock(self, name: str, offset_s: float) -> None:
        self._call("clock", name, str(offset_s))


class Ticks:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def test_kill_and_heal_are_recorded_with_targets_times_and_outcome() -> None:
    harness = FakeHarness()
    nemesis = Nemesis(harness, random.Random(1), monotonic=Ticks(100.0), wall=Ticks(1e9))
    event = nemesis.inject(FAULTS["kill-leader"])
    assert harness.calls == [("kill", "master-2")]
    assert (event.phase, event.fault, event.kind, event.outcome) == (
        "inject",
        "kill-leader",
        "kill",
        "ok",
    )
    assert event.targets == ("master-2",)
    assert event.node_ids == ()
    assert event.monotonic_s == 100.5
    assert event.wall_s == 1e9 + 0.5
    assert event.duration_s == 0.5
    assert event.details["leader_before"] == "master-2"
    assert nemesis.active == {event.seq: event}
    healed = nemesis.heal(event)
    assert harness.last() == ("restart", "master-2")
    assert (healed.phase, healed.heals, healed.outcome) == ("heal", event.seq, "ok")
    assert nemesis.active == {}
    assert [e.seq for e in nemesis.events] == [1, 2]
    json.dumps([e.to_json() for e in nemesis.events])
    again = nemesis.heal(event)
    assert again.outcome == "skipped"
    assert "not an active fault" in again.reason


def test_node_targets_carry_their_node_ids() -> None:
    harness = FakeHarness()
    event = Nemesis(harness, random.Random(2)).inject(FAULTS["pause-node"])
    assert event.targets[0] in VIEW.nodes
    assert event.node_ids == (f"id-{event.targets[0]}",)
    assert harness.calls == [("pause", event.targets[0])]


def test_partitions_cut_and_heal_exactly_their_own_pairs() -> None:
    harness = FakeHarness()
    nemesis = Nemesis(harness, random.Random(5))
    isolate = nemesis.inject(FAULTS["isolate-leader"])
    assert harness.last() == ("cut", "master-2|master-1", "master-2|master-3")
    split = nemesis.inject(FAULTS["split-masters"])
    minority = split.targets[0]
    majority = sorted(set(VIEW.masters) - {minority})
    assert harness.last() == ("cut", *(f"{minority}|{m}" for m in majority))
    from_clients = nemesis.inject(FAULTS["cut-node-from-clients"])
    assert harness.last() == ("cut", f"{from_clients.targets[0]}|{CLIENTS}")
    from_masters = nemesis.inject(FAULTS["cut-node-from-masters"])
    node = from_masters.targets[0]
    assert harness.last() == ("cut", *(f"{node}|{m}" for m in VIEW.masters))
    nemesis.heal(isolate)
    assert harness.last() == ("uncut", "master-2|master-1", "master-2|master-3")
    healed = nemesis.heal_all()
    assert [h.heals for h in healed] == [from_masters.seq, from_clients.seq, split.seq]
    assert nemesis.active == {}


def test_unsupported_faults_are_skipped_with_the_reason_and_replay_unchanged() -> None:
    schedule = [FAULTS[n] for n in ("isolate-leader", "kill-node", "slow-node-link")]
    schedule.append(Fault.make("kill", "any"))
    supported = Nemesis(FakeHarness(), random.Random(11))
    unsupported = Nemesis(FakeHarness(partitions=False, links=False), random.Random(11))
    a = [supported.inject(f) for f in schedule]
    b = [unsupported.inject(f) for f in schedule]
    assert [e.outcome for e in b] == ["skipped", "ok", "skipped", "ok"]
    assert b[0].reason == "no namespaces here"
    assert "proxies" in b[2].reason
    assert not {b[0].seq, b[2].seq} & set(unsupported.active)
    # skipping consumed the same randomness: the later choices are the same
    assert [e.targets for e in a] == [e.targets for e in b]


def test_a_failed_injection_is_recorded_and_stays_healable() -> None:
    harness = FakeHarness()
    harness.fail_on = "pause"
    nemesis = Nemesis(harness, random.Random(0))
    event = nemesis.inject(FAULTS["pause-leader"])
    assert event.outcome == "failed"
    assert "pause failed" in event.reason
    assert event.seq in nemesis.active
    assert nemesis.heal(event).outcome == "ok"
    assert harness.last() == ("resume", "master-2")


def test_link_and_clock_faults_are_set_and_put_back() -> None:
    harness = FakeHarness()
    nemesis = Nemesis(harness, random.Random(4))
    link = nemesis.inject(FAULTS["slow-master-link"])
    assert link.targets == VIEW.masters
    assert [c[:2] for c in harness.calls] == [("link", m) for m in VIEW.masters]
    assert json.loads(harness.calls[0][2])["delay_ms"] == 100
    nemesis.heal(link)
    assert json.loads(harness.calls[-1][2]) == LinkBehaviour().to_dict()
    clock = nemesis.inject(FAULTS["clock-back"])
    assert harness.last() == ("clock", clock.targets[0], "-3600.0")
    nemesis.heal(clock)
    assert harness.last() == ("clock", clock.targets[0], "0.0")


def test_rolling_restart_goes_follower_by_follower_and_the_leader_last() -> None:
    harness = FakeHarness()
    event = Nemesis(harness, random.Random(0)).inject(FAULTS["rolling-restart"])
    assert event.outcome == "ok"
    restarted = [c[1] for c in harness.calls if c[0] == "restart"]
    assert restarted == ["master-1", "master-3", "master-2"]
    assert [s["master"] for s in event.details["steps"]] == restarted
    assert harness.calls[:3] == [
        ("terminate", "master-1"),
        ("restart", "master-1"),
        ("wait_caught_up",),
    ]


def test_a_schedule_replays_from_its_seed() -> None:
    names = sorted(FAULTS)
    plan_rng = random.Random(2024)
    schedule = [FAULTS[plan_rng.choice(names)] for _ in range(40)]

    def run(seed: int) -> list[tuple[str, tuple[str, ...], str]]:
        nemesis = Nemesis(FakeHarness(VIEW5), random.Random(seed))
        out = []
        for fault in schedule:
            event = nemesis.inject(fault)
            out.append((event.fault, event.targets, event.outcome))
            if event.seq in nemesis.active:
                nemesis.heal(event)
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


# --- links ------------------------------------------------------------------------------------


def test_link_behaviour_is_validated() -> None:
    assert LinkBehaviour.from_dict({"version": 3, "delay_ms": 10, "stall": True}) == (
        LinkBehaviour(delay_ms=10.0, stall=True)
    )
    for bad in (
        {"delay_ms": -1},
        {"reset_probability": 2},
        {"stall": "yes"},
        {"speed": 1},
        {"delay_ms": "10"},
    ):
        with pytest.raises(ProxyError):
            LinkBehaviour.from_dict(bad)
    assert LinkBehaviour().clean
    assert not LinkBehaviour(jitter_ms=1).clean


def test_link_decisions_are_seeded_and_respect_the_settings() -> None:
    behaviour = LinkBehaviour(delay_ms=100, jitter_ms=50, corrupt_probability=0.5)
    shaper_a, shaper_b = LinkShaper(1, 0, "up"), LinkShaper(1, 0, "up")
    fates_a = [shaper_a.decide(behaviour, 1000) for _ in range(500)]
    fates_b = [shaper_b.decide(behaviour, 1000) for _ in range(500)]
    assert fates_a == fates_b
    other = LinkShaper(1, 0, "down")
    assert [other.decide(behaviour, 1000) for _ in range(500)] != fates_a
    assert all(0.1 <= f.delay_s < 0.15 for f in fates_a)
    corrupted = [f for f in fates_a if f.corrupt_at is not None]
    assert 150 < len(corrupted) < 350
    assert all(0 <= (f.corrupt_at or 0) < 1000 and 1 <= f.corrupt_mask <= 255 for f in corrupted)
    clean = LinkShaper(2, 0, "up")
    assert all(clean.decide(LinkBehaviour(), 100) == ChunkFate(0.0) for _ in range(100))
    always = LinkShaper(3, 0, "up")
    assert all(always.decide(LinkBehaviour(reset_probability=1.0), 10).reset for _ in range(50))


def test_clock_offsets_are_written_signed() -> None:
    assert format_offset(3600) == "+3600"
    assert format_offset(-3600.0) == "-3600"
    assert format_offset(0) == "+0"
    assert format_offset(1.5) == "+1.500000"


# --- network: names, subnets, rules -------------------------------------------------------------


def test_names_fit_the_kernel_limits() -> None:
    assert len(bridge_name("abcdef12")) <= 15
    assert len(veth_name("abcdef12", 99)) <= 15
    assert namespace_name("ab12", "master-1") == "kvp-ab12-master-1"
    for bad in ("", "ABC", "toolongid9", "a-b"):
        with pytest.raises(NetworkError):
            NamespaceNetwork(bad)


def test_the_subnet_avoids_every_network_in_use_and_depends_on_the_run_id() -> None:
    first = pick_subnet("ab12", [])
    assert first.prefixlen == 24
    assert first.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    assert pick_subnet("ab12", []) == first
    assert pick_subnet("cd34", []) != first
    taken = [first, ipaddress.IPv4Network("10.0.0.0/9")]
    other = pick_subnet("ab12", taken)
    assert not any(other.overlaps(t) for t in taken)
    with pytest.raises(NetworkError):
        pick_subnet("ab12", [ipaddress.IPv4Network("10.0.0.0/8")])


def test_partition_rules_drop_both_directions_of_exactly_the_cut_peers() -> None:
    script = partition_script(["10.1.2.5", "10.1.2.1", "10.1.2.5"])
    assert script.splitlines() == [
        "flush chain inet kvpool_chaos input",
        "flush chain inet kvpool_chaos output",
        "add rule inet kvpool_chaos input ip saddr { 10.1.2.1, 10.1.2.5 } drop",
        "add rule inet kvpool_chaos output ip daddr { 10.1.2.1, 10.1.2.5 } drop",
    ]
    assert "reject" not in script
    assert partition_script([]).splitlines() == script.splitlines()[:2]


def test_loopback_cannot_partition_and_says_why() -> None:
    net = LoopbackNetwork("not root")
    net.add_host("master-1")
    assert net.ip_of("master-1") == "127.0.0.1"
    assert net.command_prefix("master-1") == ()
    assert not net.partitions_supported
    assert "not root" in net.skip_reason
    with pytest.raises(PartitionsUnsupportedError, match="not root"):
        net.cut("master-1", "master-2")
    with pytest.raises(PartitionsUnsupportedError):
        net.cut_from_clients("master-1")
    net.heal()
    net.close()
