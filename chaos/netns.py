"""The network the chaos harness runs a cluster in: one network namespace per process, or, where
that cannot be had, everything on loopback.

:class:`NamespaceNetwork` (root only): a Linux bridge ``kvpbr-<run>`` in the root namespace
holding ``10.a.b.1/24``; one namespace ``kvp-<run>-<host>`` per host, joined to the bridge by a
veth pair (``kvp-<run>-<i>`` in the root namespace, ``eth0`` inside), with its own
``10.a.b.<i+2>`` and ``lo`` up. Client processes stay in the root namespace and reach every host
from ``10.a.b.1`` through the bridge. Partitions are nftables rules, one ``table inet
kvpool_chaos`` per namespace, that *drop* (never reject) packets to and from the cut peers in
the input and output hooks: established TCP connections go silent too, as in a real partition.

Every run writes a marker (:mod:`kvpool.chaos.runs`: owner pid and start time, what it created,
the pids started for it) *before* it creates anything, so :meth:`NamespaceNetwork.cleanup_stale`
can remove what a crashed run left behind, and nothing of a live run. While any run is live,
``net.bridge.bridge-nf-call-iptables`` is 0 (see :mod:`kvpool.chaos.runs` for why).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvpool.chaos.clock import remove_faketime_shm
from kvpool.chaos.runs import RUN_DIR, RunRegistry, marker_alive, owner_alive
from kvpool.errors import KVPoolError
from kvpool.launcher.placement import LOOPBACK_HOST
from kvpool.launcher.procfs import pid_runs_kvpool, process_start_ticks
from kvpool.logs import get_logger

CLIENTS = "clients"
"""The pseudo-host of the root namespace (workload clients, proxies) in partitions."""
TABLE = "kvpool_chaos"
_RUN_ID = re.compile(r"^[a-z0-9]{1,8}$")
_NETNS = re.compile(r"^kvp-(?P<run>[a-z0-9]{1,8})-")
_LINK = re.compile(r"^(?:kvpbr-(?P<bridge>[a-z0-9]{1,8})|kvp-(?P<veth>[a-z0-9]{1,8})-\d+)$")

Runner = Callable[[Sequence[str], str | None], str]
"""Runs a command (argv, stdin text) and returns its stdout; raises NetworkError."""


class NetworkError(KVPoolError):
    """The chaos network could not be set up, changed or removed."""

    code = "CHAOS_NETWORK"


class NetworkUnavailableError(NetworkError):
    """Network namespaces cannot be used here (the message says why)."""

    code = "CHAOS_NETWORK_UNAVAILABLE"


class PartitionsUnsupportedError(NetworkError):
    """This network cannot cut links between hosts (the message says why)."""

    code = "PARTITIONS_UNSUPPORTED"


def new_run_id() -> str:
    return secrets.token_hex(3)


def run_command(argv: Sequence[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetworkError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


# --- pure parts -------------------------------------------------------------------------------


def namespace_name(run_id: str, host: str) -> str:
    return f"kvp-{run_id}-{host}"


def bridge_name(run_id: str) -> str:
    return f"kvpbr-{run_id}"


def veth_name(run_id: str, index: int) -> str:
    return f"kvp-{run_id}-{index}"  # at most 15 characters: 4 + 8 + 1 + 2


def pick_subnet(run_id: str, used: Iterable[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps none of ``used``: the first free one from a start
    point derived from the run id (so concurrent runs start apart)."""
    taken = list(used)
    start = int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:2], "big")
    for step in range(1 << 16):
        n = (start + step) % (1 << 16)
        candidate = ipaddress.IPv4Network(f"10.{n >> 8}.{n & 0xFF}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise NetworkError("no free /24 left in 10.0.0.0/8")


def partition_script(blocked_ips: Iterable[str]) -> str:
    """The nft commands that make one namespace drop everything to and from ``blocked_ips``
    (and nothing else)."""
    ips = sorted(set(blocked_ips), key=ipaddress.IPv4Address)
    lines = [f"flush chain inet {TABLE} input", f"flush chain inet {TABLE} output"]
    if ips:
        group = ", ".join(ips)
        lines.append(f"add rule inet {TABLE} input ip saddr {{ {group} }} drop")
        lines.append(f"add rule inet {TABLE} output ip daddr {{ {group} }} drop")
    return "\n".join(lines) + "\n"


TABLE_SCRIPT = (
    f"add table inet {TABLE}\n"
    f"add chain inet {TABLE} input {{ type filter hook input priority -10 ; policy accept ; }}\n"
    f"add chain inet {TABLE} output {{ type filter hook output priority -10 ; policy accept ; }}\n"
)


# --- the interface the harness uses -----------------------------------------------------------


class Network(Protocol):
    partitions_supported: bool
    skip_reason: str
    own_network: bool

    @property
    def hosts(self) -> list[str]: ...
    @property
    def client_ip(self) -> str: ...
    def add_host(self, host: str) -> None: ...
    def ip_of(self, host: str) -> str: ...
    def command_prefix(self, host: str) -> tuple[str, ...]: ...
    def cut(self, a: str, b: str) -> None: ...
    def uncut(self, a: str, b: str) -> None: ...
    def isolate(self, host: str, from_hosts: Iterable[str]) -> None: ...
    def cut_from_clients(self, host: str) -> None: ...
    def heal(self) -> None: ...
    def blocked_pairs(self) -> list[tuple[str, str]]: ...
    def record_pid(self, pid: int) -> None: ...
    def close(self) -> None: ...


class LoopbackNetwork:
    """Every host on 127.0.0.1. No partitions: loopback traffic cannot be cut per process."""

    partitions_supported = False
    own_network = False

    def __init__(self, reason: str = "") -> None:
        self.skip_reason = (
            "partitions need network namespaces"
            + (f" ({reason})" if reason else "")
            + "; on loopback every process shares one network stack"
        )
        self._hosts: list[str] = []

    @property
    def hosts(self) -> list[str]:
        return list(self._hosts)

    @property
    def client_ip(self) -> str:
        return LOOPBACK_HOST

    def add_host(self, host: str) -> None:
        if host not in self._hosts:
            self._hosts.append(host)

    def ip_of(self, host: str) -> str:
        return LOOPBACK_HOST

    def command_prefix(self, host: str) -> tuple[str, ...]:
        return ()

    def cut(self, a: str, b: str) -> None:
        raise PartitionsUnsupportedError(self.skip_reason)

    def uncut(self, a: str, b: str) -> None:
        raise PartitionsUnsupportedError(self.skip_reason)

    def isolate(self, host: str, from_hosts: Iterable[str]) -> None:
        raise PartitionsUnsupportedError(self.skip_reason)

    def cut_from_clients(self, host: str) -> None:
        raise PartitionsUnsupportedError(self.skip_reason)

    def heal(self) -> None:
        """Nothing is ever cut here."""

    def blocked_pairs(self) -> list[tuple[str, str]]:
        return []

    def record_pid(self, pid: int) -> None:
        """Nothing to record: loopback leaves nothing behind but processes, stopped by pid."""

    def close(self) -> None:
        """Nothing to remove."""


class NamespaceNetwork:
    """One network namespace per host behind a bridge; partitions with nftables. Root only."""

    partitions_supported = True
    skip_reason = ""
    own_network = True

    def __init__(
        self,
        run_id: str,
        hosts: Iterable[str] = (),
        *,
        state_dir: str | Path = RUN_DIR,
        runner: Runner = run_command,
        owner_pid: int | None = None,
    ) -> None:
        if not _RUN_ID.match(run_id):
            raise NetworkError(f"run id must be 1-8 of [a-z0-9], not {run_id!r}")
        self.run_id = run_id
        self.runs = RunRegistry(state_dir)
        self.bridge = bridge_name(run_id)
        self.subnet: ipaddress.IPv4Network | None = None
        self._run = runner
        self._owner_pid = os.getpid() if owner_pid is None else owner_pid
        self._pending_hosts = list(dict.fromkeys(hosts))
        self._hosts: list[str] = []
        self._ips: dict[str, str] = {}
        self._veths: list[str] = []
        self._namespaces: list[str] = []
        self._pids: list[tuple[int, int | None]] = []
        self._blocked: set[frozenset[str]] = set()
        self._started = False
        self._closed = False
        self.log = get_logger("kvpool.chaos.netns").bind(run_id=run_id)

    # --- availability ------------------------------------------------------------------------

    @staticmethod
    def unsupported_reason() -> str | None:
        """Why namespaces cannot be used on this machine, or None when they can."""
        if not Path("/proc/self/ns/net").exists():
            return "this kernel has no network namespaces"
        if os.geteuid() != 0:
            return (
                f"not root (uid {os.geteuid()}): network namespaces, veth pairs and nftables "
                "need CAP_SYS_ADMIN and CAP_NET_ADMIN"
            )
        for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
            if shutil.which(tool) is None:
                return f"`{tool}` not found (install {package})"
        return _probe_namespaces()

    # --- set-up ------------------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return list(self._hosts)

    @property
    def client_ip(self) -> str:
        if self.subnet is None:
            raise NetworkError("the network is not started")
        return str(self.subnet.network_address + 1)

    def start(self) -> NamespaceNetwork:
        reason = self.unsupported_reason()
        if reason is not None:
            raise NetworkUnavailableError(f"cannot use network namespaces: {reason}")
        if self._started:
            return self
        self._started = True
        started = time.monotonic()
        try:
            with self.runs.locked():
                if self.runs.path(self.run_id).exists():
                    raise NetworkError(f"run id {self.run_id} is taken")
                used = [*self._used_networks(), *self.runs.subnets()]
                self.subnet = pick_subnet(self.run_id, used)
                self._write_marker()
                self.runs.disable_bridge_nf()
            self._run(["ip", "link", "add", self.bridge, "type", "bridge"], None)
            self._run(["ip", "addr", "add", f"{self.client_ip}/24", "dev", self.bridge], None)
            self._run(["ip", "link", "set", self.bridge, "up"], None)
            for host in self._pending_hosts:
                self.add_host(host)
        except BaseException:
            with contextlib.suppress(NetworkError):
                self.close()
            raise
        self.log.info(
            "network_started",
            subnet=str(self.subnet),
            hosts=len(self._hosts),
            elapsed_s=round(time.monotonic() - started, 3),
        )
        return self

    def add_host(self, host: str) -> None:
        """A namespace for ``host``, wired to the bridge, with its own IP."""
        if not self._started:
            if host not in self._pending_hosts:
                self._pending_hosts.append(host)
            return
        if host in self._ips:
            return
        if host == CLIENTS or not re.match(r"^[A-Za-z0-9_.\-]{1,40}$", host):
            raise NetworkError(f"not a usable host name: {host!r}")
        assert self.subnet is not None
        index = len(self._hosts)
        if index + 2 >= self.subnet.num_addresses - 1 or index > 99:
            raise NetworkError("too many hosts for one run")
        ns = namespace_name(self.run_id, host)
        veth = veth_name(self.run_id, index)
        ip = str(self.subnet.network_address + index + 2)
        self._namespaces.append(ns)
        self._veths.append(veth)
        self._write_marker()  # before creating: a crash in between leaves a listed leftover
        self._run(["ip", "netns", "add", ns], None)
        peer = ["peer", "name", "eth0", "netns", ns]
        self._run(["ip", "link", "add", veth, "type", "veth", *peer], None)
        self._run(["ip", "link", "set", veth, "master", self.bridge, "up"], None)
        self._run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"], None)
        self._run(["ip", "-n", ns, "link", "set", "eth0", "up"], None)
        self._run(["ip", "-n", ns, "link", "set", "lo", "up"], None)
        self._run(["ip", "netns", "exec", ns, "nft", "-f", "-"], TABLE_SCRIPT)
        self._hosts.append(host)
        self._ips[host] = ip

    def ip_of(self, host: str) -> str:
        if host == CLIENTS:
            return self.client_ip
        try:
            return self._ips[host]
        except KeyError:
            raise NetworkError(f"unknown host {host!r}") from None

    def namespace_of(self, host: str) -> str:
        self.ip_of(host)
        return namespace_name(self.run_id, host)

    def command_prefix(self, host: str) -> tuple[str, ...]:
        """``ip netns exec`` setns()es and then execvp()s the command: the pid stays the
        command's own."""
        return ("ip", "netns", "exec", self.namespace_of(host))

    def record_pid(self, pid: int) -> None:
        """Remember a pid started for this run, so cleanup_stale can stop it after a crash."""
        self._pids.append((pid, process_start_ticks(pid)))
        if self._started and not self._closed:
            self._write_marker()

    # --- partitions --------------------------------------------------------------------------

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b``, both ways (CLIENTS: the root namespace)."""
        self._change(add=[(a, b)])

    def uncut(self, a: str, b: str) -> None:
        self._change(remove=[(a, b)])

    def isolate(self, host: str, from_hosts: Iterable[str]) -> None:
        self._change(add=[(host, other) for other in from_hosts if other != host])

    def cut_from_clients(self, host: str) -> None:
        """Drop traffic between ``host`` and the root namespace only (clients, proxies)."""
        self._change(add=[(host, CLIENTS)])

    def heal(self) -> None:
        """Remove every partition rule."""
        self._change(remove=self.blocked_pairs())

    def blocked_pairs(self) -> list[tuple[str, str]]:
        return sorted(_pair(p) for p in self._blocked)

    def _change(
        self,
        add: Sequence[tuple[str, str]] = (),
        remove: Sequence[tuple[str, str]] = (),
    ) -> None:
        touched: set[str] = set()
        for a, b in [*add, *remove]:
            self.ip_of(a)
            self.ip_of(b)
            if a == b:
                raise NetworkError(f"cannot cut {a} from itself")
            touched.update(h for h in (a, b) if h != CLIENTS)
        for a, b in add:
            self._blocked.add(frozenset((a, b)))
        for a, b in remove:
            self._blocked.discard(frozenset((a, b)))
        for host in sorted(touched):
            peers = [next(iter(p - {host})) for p in self._blocked if host in p]
            script = partition_script(self.ip_of(p) for p in peers)
            self._run(["ip", "netns", "exec", self.namespace_of(host), "nft", "-f", "-"], script)
        if touched:
            self.log.info("partition_changed", blocked=self.blocked_pairs())

    # --- tear-down ---------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the rules, veths, namespaces and the bridge; restore the sysctl when this was
        the last live run. Idempotent; safe after a partial set-up. Processes inside the
        namespaces must be stopped first (a namespace lives as long as a process in it).
        Raises NetworkError naming what could not be removed, after trying everything."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        problems = self._remove(self.run_id, self._veths, self._namespaces, self.bridge)
        with self.runs.locked():
            self.runs.remove(self.run_id)
            try:
                self.runs.restore_bridge_nf(closing_run=self.run_id)
            except OSError as e:
                problems.append(f"restore bridge-nf-call-iptables: {e}")
        self._blocked.clear()
        if problems:
            raise NetworkError("could not remove everything: " + "; ".join(problems))
        self.log.info("network_closed")

    def _remove(
        self, run_id: str, veths: Iterable[str], namespaces: Iterable[str], bridge: str
    ) -> list[str]:
        problems: list[str] = []
        links = self._link_names()
        netns = self._netns_names()
        # veths first: deleting one end removes both at once, while a deleted namespace takes
        # its end with it only later (the kernel cleans namespaces up asynchronously).
        for veth in sorted({*veths, *(n for n in links if _link_run(n) == run_id)} - {bridge}):
            if veth in links:
                try:
                    self._run(["ip", "link", "del", veth], None)
                except NetworkError as e:
                    problems.append(str(e))
        for ns in sorted({*namespaces, *(n for n in netns if _netns_run(n) == run_id)}):
            if ns in netns:
                try:
                    self._run(["ip", "netns", "del", ns], None)
                except NetworkError as e:
                    problems.append(str(e))
        if bridge in links:
            try:
                self._run(["ip", "link", "del", bridge], None)
            except NetworkError as e:
                problems.append(str(e))
        return problems

    def __enter__(self) -> NamespaceNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def cleanup_stale(
        cls, *, state_dir: str | Path = RUN_DIR, runner: Runner = run_command
    ) -> list[str]:
        """Remove what crashed runs left: namespaces, links and markers whose owner pid is
        gone (or that have no marker at all), and kvpool processes those runs started. Live
        runs are left alone. Returns what was removed."""
        if not Path(state_dir).is_dir() or cls.unsupported_reason() is not None:
            return []
        removed: list[str] = []
        helper = cls("stale", state_dir=state_dir, runner=runner)
        with helper.runs.locked():
            markers = helper.runs.markers()
            live = {str(d["run_id"]) for d in markers if marker_alive(d)}
            stale = {str(d["run_id"]): d for d in markers if str(d["run_id"]) not in live}
            runs = set(stale)
            runs |= {r for n in helper._netns_names() if (r := _netns_run(n)) and r not in live}
            runs |= {r for n in helper._link_names() if (r := _link_run(n)) and r not in live}
            for run in sorted(runs):
                doc = stale.get(run, {})
                removed += helper._stop_stale_processes(run, doc)
                problems = helper._remove(
                    run, doc.get("veths", []), doc.get("namespaces", []), bridge_name(run)
                )
                for problem in problems:
                    helper.log.warning("stale_cleanup_failed", run=run, problem=problem)
                helper.runs.remove(run)
                removed.append(f"run {run}")
            with contextlib.suppress(OSError):
                helper.runs.restore_bridge_nf()
        if removed:
            helper.log.info("stale_runs_removed", removed=removed)
        return removed

    def _stop_stale_processes(self, run: str, doc: dict[str, Any]) -> list[str]:
        """SIGKILL the kvpool processes a dead run started (checked by start time) and those
        still inside its namespaces; remove their libfaketime shared memory."""
        removed: list[str] = []
        pids: dict[int, int | None] = {int(p): t for p, t in doc.get("pids", [])}
        for ns in self._netns_names():
            if _netns_run(ns) == run:
                with contextlib.suppress(NetworkError):
                    for line in self._run(["ip", "netns", "pids", ns], None).split():
                        pids.setdefault(int(line), None)
        for pid, ticks in pids.items():
            if owner_alive(pid, ticks) and pid_runs_kvpool(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                removed.append(f"pid {pid}")
            remove_faketime_shm(pid)
        return removed

    # --- helpers -----------------------------------------------------------------------------

    def _write_marker(self) -> None:
        doc = {
            "subnet": str(self.subnet) if self.subnet else "",
            "bridge": self.bridge,
            "namespaces": self._namespaces,
            "veths": self._veths,
            "pids": self._pids,
        }
        self.runs.write(self.run_id, self._owner_pid, doc)

    def _used_networks(self) -> list[ipaddress.IPv4Network]:
        used: list[ipaddress.IPv4Network] = []
        for entry in json.loads(self._run(["ip", "-j", "-4", "addr"], None) or "[]"):
            for addr in entry.get("addr_info", []):
                with contextlib.suppress(ValueError):
                    used.append(
                        ipaddress.IPv4Network(f"{addr['local']}/{addr['prefixlen']}", strict=False)
                    )
        for route in json.loads(self._run(["ip", "-j", "-4", "route"], None) or "[]"):
            dst = route.get("dst", "default")
            if dst != "default":
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.IPv4Network(dst, strict=False))
        return used

    def _link_names(self) -> set[str]:
        return {e["ifname"] for e in json.loads(self._run(["ip", "-j", "link"], None) or "[]")}

    def _netns_names(self) -> set[str]:
        out = self._run(["ip", "netns", "list"], None)
        return {line.split()[0] for line in out.splitlines() if line.strip()}


@functools.cache
def _probe_namespaces() -> str | None:
    """Root is not always enough (a container without CAP_SYS_ADMIN, no nf_tables): make a
    namespace and list its nftables once per process. (Its name does not start with ``kvp-``,
    so a concurrent stale clean-up leaves it alone.)"""
    name = f"kvpprobe-{os.getpid()}"
    try:
        run_command(["ip", "netns", "add", name])
    except NetworkError as e:
        return f"cannot create a network namespace ({e})"
    try:
        run_command(["ip", "netns", "exec", name, "nft", "list", "tables"])
    except NetworkError as e:
        return f"nftables does not work in a namespace ({e})"
    finally:
        with contextlib.suppress(NetworkError):
            run_command(["ip", "netns", "del", name])
    return None


def _pair(hosts: frozenset[str]) -> tuple[str, str]:
    a, b = sorted(hosts)
    return a, b


def _netns_run(name: str) -> str | None:
    m = _NETNS.match(name)
    return m.group("run") if m else None


def _link_run(name: str) -> str | None:
    m = _LINK.match(name)
    return (m.group("bridge") or m.group("veth")) if m else None
