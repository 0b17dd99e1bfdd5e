"""A cluster whose processes can be killed, paused, partitioned, slowed and clock-shifted.

    with ChaosHarness(tmp_dir, masters=3, nodes=2, proxies=True, fake_clocks=True) as h:
        with Client(h.masters_for_clients()) as kv:
            ...
        nemesis = Nemesis(h, random.Random(seed))
        event = nemesis.inject(FAULTS["isolate-leader"])
        ...
        nemesis.heal(event)

Start-up: the network (one namespace per process as root, else loopback: ``network="auto"``),
the fake clocks, then the cluster (:class:`~kvpool.launcher.cluster.LocalCluster` placed in that
network), with a :class:`~kvpool.chaos.proxy.LinkProxy` in front of every node's data address
and every master's gRPC address when ``proxies=True`` (nodes advertise their proxy; masters
advertise theirs, so a client's redirect to the leader stays on the proxied path — nodes, given
the masters' own addresses, follow such a redirect through the proxy too).

:meth:`ChaosHarness.close` stops every process it started (by pid, SIGCONT first so paused ones
can die), then the proxies, then removes the network. It is idempotent, runs on any exception
out of the ``with`` block, and is registered with ``atexit`` as a last resort;
:meth:`ChaosHarness.handle_signals` makes SIGTERM unwind like Ctrl-C does, so the ``with`` block
closes the harness then too.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kvpool.chaos.clock import FakeClocks
from kvpool.chaos.nemesis import ClusterView
from kvpool.chaos.netns import LoopbackNetwork, NamespaceNetwork, Network, new_run_id
from kvpool.chaos.proxy import LinkBehaviour, LinkProxy
from kvpool.chaos.runs import RUN_DIR
from kvpool.errors import KVPoolError
from kvpool.launcher.cluster import LocalCluster, ProcessInfo
from kvpool.launcher.placement import ProcessPlacement
from kvpool.logs import get_logger

NETWORKS = ("auto", "netns", "loopback")


class HarnessError(KVPoolError):
    """The chaos harness could not be set up, steered or torn down."""

    code = "CHAOS_HARNESS"


def derive_seed(seed: int, name: str) -> int:
    """A per-component seed from the run's seed (stable across processes and Python runs)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "big")


class _HarnessPlacement:
    """Each process in its own host of the network, under its own fake clock when on."""

    def __init__(self, network: Network, clocks: FakeClocks | None) -> None:
        self.network = network
        self.clocks = clocks

    def place(self, name: str) -> ProcessPlacement:
        self.network.add_host(name)
        return ProcessPlacement(
            host=self.network.ip_of(name),
            argv_prefix=self.network.command_prefix(name),
            env=self.clocks.env_for(name) if self.clocks is not None else {},
            own_network=self.network.own_network,
        )


class ChaosHarness:
    """Network, clocks, proxies and a cluster, set up together and torn down together."""

    def __init__(
        self,
        directory: str | Path,
        *,
        masters: int = 3,
        nodes: int = 2,
        network: str = "auto",
        proxies: bool = False,
        fake_clocks: bool = False,
        run_id: str | None = None,
        seed: int = 0,
        cpu_cache_size: str = "128MiB",
        in_memory: bool = False,
        node_timeout_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        log_level: str = "info",
        extra_master_flags: Sequence[str] = (),
        extra_node_flags: Sequence[str] = (),
        python: str = sys.executable,
        start_timeout_s: float = 60.0,
        state_dir: str | Path = RUN_DIR,
    ) -> None:
        if network not in NETWORKS:
            raise HarnessError(f"network must be one of {', '.join(NETWORKS)}, not {network!r}")
        self.dir = Path(directory).resolve()
        self.run_id = run_id or new_run_id()
        self.seed = seed
        self.network_mode = network
        self.proxies = proxies
        self.fake_clocks = fake_clocks
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.state_dir = Path(state_dir)
        self._cluster_kwargs: dict[str, Any] = {
            "masters": masters,
            "nodes": nodes,
            "cpu_cache_size": cpu_cache_size,
            "in_memory": in_memory,
            "node_timeout_s": node_timeout_s,
            "heartbeat_interval_s": heartbeat_interval_s,
            "log_level": log_level,
            "extra_master_flags": extra_master_flags,
            "extra_node_flags": extra_node_flags,
            "python": python,
        }
        self.network: Network = LoopbackNetwork("not started")
        self.clocks: FakeClocks | None = None
        self.clock_skip_reason = "" if fake_clocks else "fake clocks are off"
        self._cluster: LocalCluster | None = None
        self.node_proxies: dict[str, LinkProxy] = {}
        self.master_proxies: dict[str, LinkProxy] = {}
        self.setup_s = 0.0
        self._started = False
        self._closed = False
        self._saved_env: dict[str, str | None] = {}
        self.log = get_logger("kvpool.chaos.harness").bind(run_id=self.run_id)

    # --- set-up ------------------------------------------------------------------------------

    @property
    def cluster(self) -> LocalCluster:
        if self._cluster is None:
            raise HarnessError("the harness is not started")
        return self._cluster

    def start(self) -> ChaosHarness:
        if self._started:
            return self
        self._started = True
        began = time.monotonic()
        atexit.register(self.close)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.network = self._make_network()
            if self.fake_clocks:
                clocks = FakeClocks(self.dir / "clocks")
                if clocks.available:
                    self.clocks = clocks
                else:
                    self.clock_skip_reason = clocks.unavailable_reason
            self._cluster = LocalCluster(
                self.dir / "cluster",
                placement=_HarnessPlacement(self.network, self.clocks),
                advertise_master=self._proxy_master if self.proxies else None,
                advertise_node_data=self._proxy_node_data if self.proxies else None,
                on_spawn=self._spawned,
                **self._cluster_kwargs,
            )
            self._cluster.start(self.start_timeout_s)
            # A cluster in network namespaces has a cluster token (it listens beyond
            # loopback): clients of this process and of its workload children find it in the
            # environment, as kvpool clients do; restored on close.
            for key, value in self._cluster.client_env.items():
                self._saved_env.setdefault(key, os.environ.get(key))
                os.environ[key] = value
        except BaseException:
            with contextlib.suppress(KVPoolError):
                self.close()
            raise
        self.setup_s = time.monotonic() - began
        self.log.info(
            "harness_started",
            network=type(self.network).__name__,
            proxies=self.proxies,
            fake_clocks=self.clocks is not None,
            elapsed_s=round(self.setup_s, 3),
        )
        return self

    def _make_network(self) -> Network:
        if self.network_mode == "loopback":
            return LoopbackNetwork("loopback was asked for")
        reason = NamespaceNetwork.unsupported_reason()
        if reason is not None and self.network_mode == "auto":
            self.log.info("network_fallback", reason=reason)
            return LoopbackNetwork(reason)
        if reason is None:
            # what crashed runs left behind (their owner is gone) goes first
            NamespaceNetwork.cleanup_stale(state_dir=self.state_dir)
        return NamespaceNetwork(self.run_id, state_dir=self.state_dir).start()

    def _spawned(self, info: ProcessInfo) -> None:
        self.network.record_pid(info.pid)

    def _new_proxy(self, name: str, target: str) -> LinkProxy:
        proxy = LinkProxy(
            name,
            listen_host=self.network.client_ip,
            target=target,
            directory=self.dir / "proxies",
            seed=derive_seed(self.seed, name),
            python=self.python,
        )
        proxy.start()
        self.network.record_pid(proxy.pid)
        return proxy

    def _proxy_master(self, name: str, bound: str) -> str:
        proxy = self.master_proxies.get(name)
        if proxy is None:
            proxy = self.master_proxies[name] = self._new_proxy(f"{name}-grpc", bound)
        return proxy.address

    def _proxy_node_data(self, name: str, bound: str) -> str:
        proxy = self.node_proxies.get(name)
        if proxy is None:
            proxy = self.node_proxies[name] = self._new_proxy(f"{name}-data", bound)
        return f"tcp://{proxy.address}"

    def __enter__(self) -> ChaosHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what a workload and a runner need -----------------------------------------------------

    def masters_for_clients(self) -> list[str]:
        """The master addresses a workload should use (the proxies' when proxies are on)."""
        return self.cluster.client_master_addresses

    @property
    def partitions_supported(self) -> bool:
        return self.network.partitions_supported

    @property
    def skip_reason(self) -> str:
        """Why partitions are not supported here ("" when they are)."""
        return self.network.skip_reason

    @property
    def links_supported(self) -> bool:
        return self.proxies

    @property
    def clocks_supported(self) -> bool:
        return self.clocks is not None

    @property
    def master_names(self) -> list[str]:
        return self.cluster.master_names

    @property
    def node_names(self) -> list[str]:
        return self.cluster.node_names

    def node_id_of(self, name: str) -> str:
        info = self.cluster.processes.get(name)
        return info.node_id if info is not None and info.node_id else name

    def leader(self) -> str | None:
        address = self.cluster.find_leader()
        return self.cluster.name_of_master(address) if address else None

    def view(self) -> ClusterView:
        c = self.cluster
        names = [*c.master_names, *c.node_names]
        return ClusterView(
            masters=tuple(c.master_names),
            nodes=tuple(c.node_names),
            leader=self.leader(),
            down=frozenset(n for n in names if not c.is_running(n)),
            paused=frozenset(n for n in names if c.is_paused(n)),
        )

    # --- faults (the nemesis's hands) ----------------------------------------------------------

    def kill(self, name: str) -> None:
        self.cluster.kill(name)

    def restart(self, name: str) -> None:
        self.cluster.restart(name, timeout_s=self.start_timeout_s)

    def terminate(self, name: str) -> None:
        self.cluster.terminate(name)

    def pause(self, name: str) -> None:
        self.cluster.pause(name)

    def drain(self, name: str, timeout_s: float) -> int:
        """Ask the leader to move every block off node ``name`` and declare it left; the
        blocks still only there when it answered (0: drained)."""
        from kvpool.grpcutil import call_once_sync
        from kvpool.proto.v1 import master_pb2, master_pb2_grpc

        response = call_once_sync(
            self.cluster.wait_for_leader(),
            master_pb2_grpc.MasterStub,
            "DrainNode",
            master_pb2.DrainNodeRequest(node_id=self.node_id_of(name), wait=True),
            timeout_s=timeout_s,
            security=self.cluster.security,  # the cluster token when it runs in namespaces
        )
        return int(response.blocks_left)

    def resume(self, name: str) -> None:
        self.cluster.resume(name)

    def wait_caught_up(self, timeout_s: float) -> bool:
        return self.cluster.wait_caught_up(timeout_s)

    def cut(self, pairs: Sequence[tuple[str, str]]) -> None:
        for a, b in pairs:
            self.network.cut(a, b)

    def uncut(self, pairs: Sequence[tuple[str, str]]) -> None:
        for a, b in pairs:
            self.network.uncut(a, b)

    def link_of(self, name: str) -> LinkProxy:
        proxy = self.node_proxies.get(name) or self.master_proxies.get(name)
        if proxy is None:
            raise HarnessError(f"{name} has no link proxy (start the harness with proxies=True)")
        return proxy

    def set_link(self, name: str, behaviour: LinkBehaviour) -> None:
        self.link_of(name).set(behaviour)

    def jump_clock(self, name: str, offset_s: float) -> None:
        if self.clocks is None:
            raise HarnessError(f"no fake clocks: {self.clock_skip_reason}")
        self.clocks.jump(name, offset_s)

    # --- tear-down -----------------------------------------------------------------------------

    def started_pids(self) -> list[int]:
        pids = list(self._cluster.started_pids) if self._cluster is not None else []
        return pids + [p.pid for p in [*self.node_proxies.values(), *self.master_proxies.values()]]

    def close(self) -> None:
        """Stop every process started (cluster, then proxies), remove the network. Idempotent.
        Raises HarnessError naming what could not be cleaned up, after trying everything."""
        if self._closed:
            return
        self._closed = True
        for key, saved in self._saved_env.items():
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved
        began = time.monotonic()
        problems: list[str] = []
        # Heal first: processes that can reach each other shut down gracefully and fast.
        with contextlib.suppress(KVPoolError, OSError):
            self.network.heal()
        for proxy in [*self.node_proxies.values(), *self.master_proxies.values()]:
            with contextlib.suppress(KVPoolError, OSError):
                proxy.set(LinkBehaviour(), wait_s=0.0)
        if self._cluster is not None:
            try:
                self._cluster.stop()
            except (KVPoolError, OSError) as e:
                problems.append(f"cluster: {e}")
        for proxy in [*self.node_proxies.values(), *self.master_proxies.values()]:
            try:
                proxy.stop()
            except (KVPoolError, OSError) as e:
                problems.append(f"proxy {proxy.name}: {e}")
        try:
            self.network.close()
        except (KVPoolError, OSError) as e:
            problems.append(f"network: {e}")
        atexit.unregister(self.close)
        self.log.info("harness_closed", elapsed_s=round(time.monotonic() - began, 3))
        if problems:
            raise HarnessError("harness clean-up incomplete: " + "; ".join(problems))

    @contextlib.contextmanager
    def handle_signals(self) -> Iterator[ChaosHarness]:
        """Inside this block (main thread only) SIGTERM and SIGHUP raise KeyboardInterrupt,
        as Ctrl-C does, so an enclosing ``with`` closes the harness. Handlers are restored at
        the end."""
        previous: dict[signal.Signals, Any] = {}

        def interrupt(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, interrupt)
        try:
            yield self
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)

    @staticmethod
    def cleanup_stale(state_dir: str | Path = RUN_DIR) -> list[str]:
        """Remove what crashed runs left behind (namespaces, links, processes); see
        :meth:`NamespaceNetwork.cleanup_stale`. Nothing to do without root."""
        if NamespaceNetwork.unsupported_reason() is not None:
            return []
        return NamespaceNetwork.cleanup_stale(state_dir=state_dir)
