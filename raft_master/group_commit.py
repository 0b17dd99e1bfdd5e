"""Group commit: CommitPuts requests arriving while a Raft entry is in flight share the next one.

The next entry is a ``Batch`` whose sub-commands keep their own request ids and results, up to
``max_entries`` put entries per Raft entry; a request is never split (a larger one goes alone).
One Raft entry is in flight at a time.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvpool.errors import InternalError, KVPoolError
from kvpool.raft_master.commands import (
    Batch,
    BatchResult,
    CommitPuts,
    CommitPutsResult,
    Result,
    SimpleCommand,
)

Propose = Callable[[SimpleCommand | Batch, float], Awaitable[Result]]
_DRIVING = object()
"""Stands for the flush task while a submitter proposes its own request directly."""


@dataclass
class GroupCommitStats:
    requests: int = 0
    entries: int = 0
    raft_entries: int = 0
    largest_batch_requests: int = 0


class GroupCommitter:
    """Merges CommitPuts requests arriving while a Raft entry is in flight into the next one.

    One Raft entry in flight at a time; a request is never split (one larger than
    ``max_entries`` goes alone)."""

    def __init__(self, propose: Propose, *, max_entries: int, timeout_s: float) -> None:
        self._propose = propose
        self._max_entries = max_entries
        self._timeout_s = timeout_s
        self._pending: deque[tuple[CommitPuts, asyncio.Future[CommitPutsResult]]] = deque()
        self._task: asyncio.Task[None] | object | None = None
        self.stats = GroupCommitStats()

    async def submit(self, command: CommitPuts) -> CommitPutsResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[CommitPutsResult] = loop.create_future()
        self._pending.append((command, future))
        if self._task is None:
            if len(self._pending) == 1:
                # Idle: propose this request from here, without a task's start-up turn of the
                # loop; requests arriving meanwhile are taken by a flush task started after.
                self._task = _DRIVING
                try:
                    await self._commit(self._take())
                finally:
                    self._task = None
                    if self._pending:
                        self._task = loop.create_task(self._flush())
                return await future
            self._task = loop.create_task(self._flush())
        return await future

    def _take(self) -> list[tuple[CommitPuts, asyncio.Future[CommitPutsResult]]]:
        batch: list[tuple[CommitPuts, asyncio.Future[CommitPutsResult]]] = []
        entries = 0
        while self._pending:
            command, future = self._pending[0]
            if future.done():  # the caller went away before we proposed it
                self._pending.popleft()
                continue
            if batch and entries + len(command.entries) > self._max_entries:
                break
            self._pending.popleft()
            batch.append((command, future))
            entries += len(command.entries)
        return batch

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._take()
                if batch:
                    await self._commit(batch)
        finally:
            self._task = None

    async def _commit(
        self, batch: list[tuple[CommitPuts, asyncio.Future[CommitPutsResult]]]
    ) -> None:
        commands = [c for c, _ in batch]
        proposal: SimpleCommand | Batch = (
            commands[0] if len(commands) == 1 else Batch(os.urandom(16), tuple(commands))
        )
        try:
            result = await self._propose(proposal, self._timeout_s)
            results = list(result.results) if isinstance(result, BatchResult) else [result]
            if len(results) != len(batch):
                raise InternalError(f"{len(results)} results for {len(batch)} commands")
        except Exception as e:
            error = e if isinstance(e, KVPoolError) else InternalError(f"{type(e).__name__}: {e}")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        self.stats.raft_entries += 1
        self.stats.requests += len(batch)
        self.stats.entries += sum(len(c.entries) for c in commands)
        self.stats.largest_batch_requests = max(self.stats.largest_batch_requests, len(batch))
        for (_, future), sub in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(sub, CommitPutsResult):
                future.set_result(sub)
            else:
                future.set_exception(InternalError(f"unexpected result {type(sub).__name__}"))
