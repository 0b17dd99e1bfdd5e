"""Calling the master group: leader discovery, redirects, retries inside one deadline.

Used by the client SDK and by store nodes. Writes go to the leader: a follower answers
NOT_LEADER with the leader's address, which becomes the preferred master. Reads may go to any
master (a stale answer can only cause a miss). Every retry stays inside the caller's deadline
(``loop.time()`` based); one attempt never takes more than ``attempt_timeout_s`` so a paused
master cannot eat the whole budget.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import grpc.aio

from kvpool.errors import (
    DeadlineExceededError,
    KVPoolError,
    NotCaughtUpError,
    NotLeaderError,
    UnavailableError,
)
from kvpool.grpcutil import create_channel, unary
from kvpool.proto.v1 import master_pb2_grpc


class Backoff:
    """Exponential backoff with full jitter, capped."""

    def __init__(self, base_s: float = 0.02, cap_s: float = 0.5) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempt = 0

    def next_delay(self) -> float:
        delay = min(self.cap_s, self.base_s * (2**self.attempt))
        self.attempt += 1
        return random.uniform(0, delay)


class MasterClient:
    """Stubs for every master, a preferred (leader) address, and a retrying ``call``."""

    def __init__(self, addresses: Sequence[str], *, attempt_timeout_s: float = 1.0) -> None:
        if not addresses:
            raise UnavailableError("no master addresses given")
        self._addresses: list[str] = list(dict.fromkeys(addresses))
        self._attempt_timeout_s = attempt_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, master_pb2_grpc.MasterStub] = {}
        self.leader: str | None = None
        self._rotation = 0

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def stub(self, address: str) -> master_pb2_grpc.MasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = create_channel(address)
            self._channels[address] = channel
            stub = master_pb2_grpc.MasterStub(channel)
            self._stubs[address] = stub
        return stub

    def _order(self, prefer_leader: bool) -> list[str]:
        """Addresses to try: the leader first when known, then the others, rotating."""
        n = len(self._addresses)
        self._rotation = (self._rotation + 1) % n
        rest = self._addresses[self._rotation :] + self._addresses[: self._rotation]
        if prefer_leader and self.leader in self._addresses:
            rest.remove(self.leader)
            return [self.leader, *rest]
        return rest

    async def call(
        self,
        method: str,
        request: Any,
        *,
        deadline: float,
        leader_only: bool = False,
    ) -> Any:
        """Call ``Master.<method>`` until it succeeds, a non-retryable error is raised, or the
        deadline (``asyncio`` loop time) passes (DeadlineExceededError, with the last error)."""
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        last: KVPoolError | None = None
        redirects = 0
        while True:
            order = self._order(prefer_leader=True)
            redirected = False
            for address in order:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    response = await unary(
                        getattr(self.stub(address), method),
                        request,
                        timeout_s=min(remaining, self._attempt_timeout_s),
                        address=address,
                    )
                except NotLeaderError as e:
                    last = e
                    if e.leader and e.leader != address:
                        if e.leader not in self._addresses:
                            self._addresses.append(e.leader)
                        self.leader = e.leader
                        redirected = True
                        redirects += 1
                        break  # start over with the leader first
                    if self.leader == address:
                        self.leader = None
                    continue
                except (UnavailableError, DeadlineExceededError, NotCaughtUpError) as e:
                    last = e
                    if self.leader == address:
                        self.leader = None
                    continue
                except KVPoolError as e:
                    if not e.retryable:
                        raise
                    last = e
                    continue
                if leader_only:
                    self.leader = address
                return response
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"Master.{method}: no master answered in time"
                    + (f" (last error: {last.message})" if last else "")
                )
            if not redirected or redirects % 4 == 0:  # masters may disagree during an election
                await asyncio.sleep(min(backoff.next_delay(), remaining))

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close()
