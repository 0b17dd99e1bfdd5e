"""Where a launched process runs: the IP it binds and advertises, the argv prefix that puts it
there (``ip netns exec …``), extra environment (a fake clock), and which ports it can use.

A prefix must *exec* the kvpool command (``ip netns exec`` and ``env`` do), so that the pid the
launcher holds is the kvpool process itself; :class:`~kvpool.launcher.cluster.LocalCluster`
checks it against the pid each process writes into its ready file.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

LOOPBACK_HOST = "127.0.0.1"

# Ports of a process that has a network stack of its own (a namespace): nothing else binds
# there, so they are fixed, and a restarted process comes back on the same addresses.
MASTER_GRPC_PORT = 7300
MASTER_RAFT_PORT = 7310
NODE_ADMIN_PORT = 7320
NODE_DATA_PORT = 7400


@dataclass(frozen=True)
class ProcessPlacement:
    """Where one process runs: the IP it binds and advertises, the argv prefix that puts it
    there, extra environment, and whether it has a network stack of its own (then the
    well-known ports are free for it)."""

    host: str = LOOPBACK_HOST
    argv_prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    own_network: bool = False


class Placement(Protocol):
    def place(self, name: str) -> ProcessPlacement: ...


class LoopbackPlacement:
    """Every process on 127.0.0.1 of this host, no prefix, no extra environment."""

    def place(self, name: str) -> ProcessPlacement:
        return ProcessPlacement()


AdvertiseHook = Callable[[str, str], str]
"""``(process name, bound host:port) -> address to advertise`` (a proxy in front of it)."""


PICKED_PORTS = (20000, 32767)
"""Where :func:`free_port` picks: below Linux's default ephemeral range (32768-60999), so that
no outgoing connection can take a picked port between the pick and the server's bind."""


_HANDED_OUT: deque[int] = deque(maxlen=2048)
_HANDED_LOCK = threading.Lock()


def free_port(host: str = LOOPBACK_HOST) -> int:
    """A port on ``host`` that a server started next can bind: a random one below the
    ephemeral range that binds now and that this process has not handed out lately (the
    kernel's choice after 64 tries).

    A picked port is only free until its server binds it; the processes of one group are
    started together, so two picks of the same port before either bound it would make one of
    them fail with "address already in use". Remembering the last 2,048 ports handed out
    rules that out within this process (a restarted process keeps its port, and a picker in
    another process is refused by the bind check once the port is taken)."""
    low, high = PICKED_PORTS
    with _HANDED_LOCK:
        for _ in range(64):
            port = random.randint(low, high)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.append(port)
            return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _HANDED_OUT.append(port)
        return port
