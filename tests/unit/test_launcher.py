"""The launcher's port picking: below the ephemeral range, bindable, a fallback when full."""

from __future__ import annotations

import socket
from collections import deque

import pytest

from kvpool.launcher import placement
from kvpool.launcher.placement import PICKED_PORTS, free_port


def test_picked_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low, high = PICKED_PORTS
    for _ in range(20):
        port = free_port()
        assert low <= port <= high  # no outgoing connection can be handed it meanwhile
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_busy_range_falls_back_to_the_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        monkeypatch.setattr(placement, "PICKED_PORTS", (taken, taken))
        port = placement.free_port()
        assert port != taken
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_ports_picked_together_are_never_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    # a group's processes are started together: a port picked twice before either process
    # bound it fails the second one with "address already in use" (a CI failure, once)
    low = free_port()
    monkeypatch.setattr(placement, "PICKED_PORTS", (low, low + 1))
    for _ in range(10):
        monkeypatch.setattr(placement, "_HANDED_OUT", deque(maxlen=2048))
        first, second = placement.free_port(), placement.free_port()
        assert first != second
