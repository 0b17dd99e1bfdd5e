"""Versions come from the index, never from a PUBLISH frame (a peer's claim is not trusted).

A PUBLISH that carries the commit's receipt — the leader's signature of (key, write id, version),
:mod:`kvpool.receipts` — is settled by the data server at once with that version, when the
receipt checks and no other staged write of the key here claims a newer one. This module is the
rest: what the index is asked when there is no such proof.

A node keeps at most one committed block per key and decides between two writes of a key by
their versions. The version a PUBLISH frame names is only the sender's word: one raw PUBLISH of
a staged block with version 2^64-1 made the node refuse every later write of that key (each
answered "put: True", each read back a miss). So before a staged block is published the node asks
the index which write of the key it holds, and with what version: published with *that*
version when the index names exactly this write id. When it names another write at least as new
as the frame claims, this one was replaced (or never committed): the staged block is dropped at
once — a reader holding a stale cached entry then misses and looks the key up again, instead of
reading the replaced value — and the PUBLISH is answered MISS WRONG_VERSION. Otherwise (the key
unknown, or an older write named: an index that may lag) the block is left staged for the
staged reaper, and nothing else changes.

Asking costs one Lookup on the leader per batch: requests that arrive while one Lookup is in
flight, or within :data:`BATCH_WINDOW_S`, share the next one (up to :data:`BATCH_KEYS` keys).
The leader is asked because the client's commit was acknowledged by it after it applied the
entry (a lagging follower might not know the write yet). Nothing waits for it on the put path:
a staged block is already readable by its exact write id, and clients do not wait for PUBLISH.
When the index cannot be asked the block stays staged and the PUBLISH is answered MISS STAGED;
the node asks again in the background (after 0.2 s, the pause doubling up to 2 s, for 30 s:
``data_server.SETTLE_*``) and settles it as above once a master answers — a full restart of the
masters right after a put left every block of it unreadable until the staged reaper's
``staged_ttl_s`` — and the staged reaper settles whatever is still staged after that.
Meanwhile the key's older committed block (by the claimed version) has already left the table
(:meth:`~kvpool.store_node.block_store.BlockStore.retire_older`): a reader with a stale entry
misses and looks the key up again, it never reads the replaced value after the put was
acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, NamedTuple, Protocol

from kvpool import receipts
from kvpool.errors import InternalError, KVPoolError, UnavailableError
from kvpool.logs import OncePer, get_logger
from kvpool.proto.v1 import master_pb2

BATCH_KEYS = 1024
BATCH_WINDOW_S = 0.002


class Verdict(NamedTuple):
    """The index's answer about one write: ``version`` of exactly this write (None: it names
    another one, or none), and the ``other`` version it names instead (0: none)."""

    version: int | None
    other: int


class LookupCaller(Protocol):
    """What is needed of :class:`kvpool.mastercall.MasterClient`."""

    async def call(
        self, method: str, request: Any, *, deadline: float, leader_only: bool = False
    ) -> Any: ...


class IndexVersions:
    """Answers "which version does the index give this write?" in batched leader Lookups."""

    def __init__(self, masters: LookupCaller, *, timeout_s: float, log: Any = None) -> None:
        self._masters = masters
        self._timeout_s = timeout_s
        self._events = log if log is not None else get_logger("kvpool.node.publish")
        self._log = OncePer(self._events)
        self._pending: dict[str, list[tuple[int, asyncio.Future[Verdict]]]] = {}
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self.lookups = 0
        self.confirmed = 0
        self.refused = 0
        self.receipt_key = b""
        """Checks commit receipts (:mod:`kvpool.receipts`), once a master has answered it."""

    def learn_key(self, raw: bytes) -> None:
        """The receipt key a master answered (ignored unless it has a key's length)."""
        key = receipts.usable_key(raw)
        if key and key != self.receipt_key:
            self._events.info("receipt_key_learned", replaced=bool(self.receipt_key))
            self.receipt_key = key

    def proves(self, key_bytes: bytes, write_id: int, version: int, receipt: int) -> bool:
        """Whether ``receipt`` is the index's signature of this write at ``version``."""
        return receipts.check(self.receipt_key, key_bytes, write_id, version, receipt)

    async def version_of(self, key: str, write_id: int) -> Verdict:
        """What the index says of ``(key, write_id)``. Raises a KVPoolError when it could not
        be asked."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        self._pending.setdefault(key, []).append((write_id, future))
        if self._runner is None or self._runner.done():
            self._wake = asyncio.Event()
            self._runner = loop.create_task(self._run(), name="node-publish-check")
        assert self._wake is not None
        self._wake.set()
        return await future

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        self._fail_all(UnavailableError("the node is stopping"))

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            await asyncio.sleep(BATCH_WINDOW_S)
            while self._pending:
                await self._ask_once()

    async def _ask_once(self) -> None:
        keys = list(self._pending)[:BATCH_KEYS]
        waiting = {key: self._pending.pop(key) for key in keys}
        loop = asyncio.get_running_loop()
        self.lookups += 1
        try:
            response = await self._masters.call(
                "Lookup",
                master_pb2.LookupRequest(keys=keys, internal=True),
                deadline=loop.time() + self._timeout_s,
                leader_only=True,
            )
        except Exception as e:  # any failure is the waiting PUBLISHes' answer (not only a
            # KVPoolError: anything else would leave them waiting for good)
            error = e if isinstance(e, KVPoolError) else InternalError(f"publish check: {e!r}")
            self._log.warning(
                "publish_check_failed", error.code, keys=len(keys), error=error.message
            )
            for items in waiting.values():
                for _, future in items:
                    if not future.done():
                        future.set_exception(error)
            return
        except asyncio.CancelledError:
            for items in waiting.values():
                for _, future in items:
                    future.cancel()
            raise
        entries = dict(zip(keys, response.entries, strict=False))
        for key, items in waiting.items():
            entry = entries.get(key)
            for write_id, future in items:
                if future.done():
                    continue
                if entry is not None and entry.found and entry.write_id == write_id:
                    self.confirmed += 1
                    future.set_result(Verdict(int(entry.version), 0))
                else:
                    self.refused += 1
                    other = int(entry.version) if entry is not None and entry.found else 0
                    future.set_result(Verdict(None, other))

    def _fail_all(self, error: KVPoolError) -> None:
        pending, self._pending = self._pending, {}
        for items in pending.values():
            for _, future in items:
                if not future.done():
                    future.set_exception(error)
