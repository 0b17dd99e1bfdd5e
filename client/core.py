"""The client SDK's one implementation: an async core that every front end wraps.

:class:`ClientCore` holds the masters (:class:`~kvpool.mastercall.MasterClient`), the
data-plane connection pool, the cached placement and the read-your-writes floor. All of its
methods are coroutines and must run on one event loop; the synchronous
:class:`~kvpool.client.sync.Client` runs them on a private loop thread, an async front end can
await them directly.

Failure policy, in one place: bad input raises the typed caller error in every mode; a failure
of the cache (no master, node down, timeout, checksum mismatch, miss) returns the call's
neutral answer (None, False, 0) and is counted in :attr:`ClientCore.stats`, or, with
``strict``, raises the typed error. Every call runs under one deadline of ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from opentelemetry.trace import SpanKind

from kvpool import tracing
from kvpool.client.blocks import BlockRef, DataPlane, PutItem, ReadItem
from kvpool.client.cache import LookupCache
from kvpool.client.client_metrics import ClientMetrics
from kvpool.client.commits import (
    AfterCommit,
    AsyncCommitter,
    CommitAnswer,
    PutReceipt,
    committed_entry,
    judge_commit,
    put_entries,
    superseded,
)
from kvpool.client.hedge import HedgePolicy
from kvpool.client.links import Links
from kvpool.client.ops import (
    DELETE_WAIT_S,
    Commit,
    EnsureMembers,
    Lookup,
    Publish,
    PutFlow,
    ReadFlow,
    SinkFactory,
    Stage,
    put_flow,
    read_flow,
)
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.spans import read_attributes
from kvpool.client.stats import ClientStats
from kvpool.client.values import (
    BytesLike,
    PutItems,
    WritableBuffer,
    as_payload,
    as_sink,
    check_fits,
    put_items,
    validate_key,
    validate_key_names,
    validate_keys,
)
from kvpool.config import ClientConfig
from kvpool.errors import (
    BlockMissError,
    ConfigError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KVPoolError,
    PinQuotaExceededError,
    StaleRingError,
    UnavailableError,
)
from kvpool.logs import get_logger
from kvpool.mastercall import MasterClient, MasterRouting
from kvpool.proto.v1 import master_pb2
from kvpool.transports.tcp import ConnectionPool

__all__ = ["ClientCore", "PutReceipt", "RevisionFloor", "tier_limit"]

T = TypeVar("T")

DEADLINE_SLACK_S = 0.05
"""A call's guard fires this long after its deadline, should any step overrun it."""
MAX_COMMIT_ENTRIES = 8192
"""Most entries in one CommitPuts (the masters' default commit_batch_max_entries); a larger
batch_put commits in several calls, concurrently."""
EMPTY_RING_ASKS = 4
"""How many times a put asks for the membership while the answer names no node that takes
puts: right after a cluster starts a follower may answer before it has applied the nodes'
registrations (GetMembers is answered by any master); the masters are asked in turn."""


def empty_ring_delay(attempt: int) -> float:
    """The pause before asking again for the membership after an empty answer."""
    return 0.02 * attempt


PREFIX_LOOKUP_MAX_KEYS = 1024
"""prefix_match of at most this many keys is a Lookup (entries cached for the reads that follow)
unless the caller asks for a count only; a longer chain asks PrefixMatch, which answers a count
only."""


def leading_hits(response: master_pb2.LookupResponse) -> int:
    """prefix_match from a Lookup: the leading run of found keys. The entries are in the lookup
    cache by then, so the get of the hits that an engine sends next needs no second index round
    trip."""
    entries = response.entries
    return next((i for i, e in enumerate(entries) if not e.found), len(entries))


MASTER_ATTEMPT_S = 0.5
"""The longest one call waits for one master before asking another: a paused leader costs a
writer this long (a new leader is elected within ~0.3-0.7 s; a retried commit applies once)."""

TIER_LIMITS: dict[str, int] = {"": 0, "any": 0, "gpu": 1, "cpu": 2, "ssd": 3}
"""``max_tier`` names: the slowest tier a get accepts (a block held only on a slower one is a
miss, ``slow_tier``, without reading it)."""


def tier_limit(max_tier: str) -> int:
    """The TierLevel for a ``max_tier`` name; InvalidArgumentError for an unknown one."""
    try:
        return TIER_LIMITS[max_tier.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgumentError(
            f"max_tier: expected one of gpu, cpu, ssd or any, got {max_tier!r}"
        ) from None


PIN_OK = master_pb2.PIN_STATUS_OK
PIN_QUOTA = master_pb2.PIN_STATUS_QUOTA_EXCEEDED


class RevisionFloor:
    """The highest index revision a client has committed, removed or read at; its lookups ask
    for at least this much (read-your-writes, monotonic reads). Shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def raise_to(self, revision: int) -> None:
        if revision > self.value:
            with self._lock:
                self.value = max(self.value, revision)


def _miss_reason(error: KVPoolError) -> str:
    return "timeout" if isinstance(error, DeadlineExceededError) else "unavailable"


class ClientCore:
    """Put, get, remove and look up blocks; see the module doc for the failure policy."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        strict: bool = False,
        logger: Any = None,
        masters: MasterClient | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        if not isinstance(strict, bool):
            raise ConfigError(f"strict: expected True or False, got {strict!r}")
        self.config = config
        self.strict = strict
        self._log = logger if logger is not None else get_logger("kvpool.client")
        tracing.setup_client_tracing()
        attempt_s = min(MASTER_ATTEMPT_S, config.timeout_s)
        self.attempt_timeout_s = attempt_s
        self.security = config.security()
        self.routing = masters.routing if masters is not None else MasterRouting(config.masters)
        self._masters = masters or MasterClient(
            config.masters,
            attempt_timeout_s=attempt_s,
            routing=self.routing,
            security=self.security,
        )
        self.links = Links(config.transport)
        self.hedge_policy = HedgePolicy(config.hedge_reads, config.hedge_delay_ms / 1000)
        self._placement = Placement(is_local=self.links.is_local)
        self._data = DataPlane(
            pool,
            self._node_failed,
            links=self.links,
            pool_size=config.connections_per_node,
            connect_timeout_s=attempt_s,
            token=self.security.token,
            hedge=self.hedge_policy,
            on_node_slow=self._node_slow,
            on_hedge=self._stats_hedged,
        )
        self.cache = LookupCache(config.lookup_cache_size, config.lookup_cache_ttl_s)
        self.floor = RevisionFloor()
        self._stats = ClientStats()
        self.metrics = ClientMetrics(self._stats)
        self._committer = AsyncCommitter(self._commit_rpc, lambda: MAX_COMMIT_ENTRIES)
        self._members_lock = asyncio.Lock()
        self._closed = False
        self._shut = False

    # --- state ----------------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def counters(self) -> ClientStats:
        return self._stats

    @property
    def stats(self) -> dict[str, Any]:
        """Counters (a copy; safe from any thread): see ClientStats.snapshot."""
        return self._stats.snapshot()

    @property
    def read_floor(self) -> int:
        """The highest index revision this client committed or removed at; lookups ask the
        master to have applied at least this much (read-your-writes)."""
        return self.floor.value

    @property
    def closed(self) -> bool:
        return self._closed

    def mark_closed(self) -> None:
        """Refuse further calls (the synchronous client closes its own parts first)."""
        self._closed = True

    async def close(self) -> None:
        """Close connections and channels; idempotent. Later calls raise UnavailableError."""
        if self._shut:
            return
        self._shut = True
        self._closed = True
        await self.metrics.close()
        await self._data.close()
        await self._masters.close()

    async def start_metrics(self) -> str:
        """Serve this client's /metrics when ``metrics_port`` asks for it; its address."""
        return await self.metrics.start(self.config.metrics_host, self.config.metrics_port)

    # --- public operations -------------------------------------------------------------------

    async def put(self, key: str, value: BytesLike, *, strict: bool | None = None) -> bool:
        """Store one block. True once committed to the index (and published)."""
        return await self.put_receipt(key, value, strict=strict) is not None

    async def put_receipt(
        self, key: str, value: BytesLike, *, strict: bool | None = None
    ) -> PutReceipt | None:
        """Store one block, as :meth:`put`: its receipt once committed, None on failure
        (strict: the typed error, as put raises it)."""
        item = self.put_item(key, value)
        (receipt,) = await self._put_prepared([item], self._strict(strict), single=True)
        return receipt

    async def batch_put(self, items: PutItems, *, strict: bool | None = None) -> list[bool]:
        """Store many blocks with one CommitPuts; one bool per item, in order. With strict, a
        failure of the whole call raises; per-item failures stay False."""
        receipts = await self.batch_put_receipts(items, strict=strict)
        return [r is not None for r in receipts]

    async def batch_put_receipts(
        self, items: PutItems, *, strict: bool | None = None
    ) -> list[PutReceipt | None]:
        """As :meth:`batch_put`, with each committed item's receipt (None where it failed)."""
        prepared = [self.put_item(k, v) for k, v in put_items(items)]
        if not prepared:
            return []
        return await self._put_prepared(prepared, self._strict(strict), single=False)

    async def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        """The block's bytes, or None on a miss or any failure (strict: the typed error).
        ``max_tier`` (gpu, cpu, ssd; default: the config's): a block held only on a slower
        tier is a miss — for an engine that recomputes faster than it reads the SSD."""
        pair = (key, validate_key(key))
        strict = self._strict(strict)
        limit = self._tier_limit(max_tier)
        items = await self._read_or_fail([pair], fresh_bytes, strict, limit)
        if items is None or not self.settle(items[0], pair[0], strict):
            return None
        item = items[0]
        assert item is not None
        return item.result()

    async def get_into(
        self,
        key: str,
        buffer: WritableBuffer,
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> int | None:
        """Read the block into ``buffer``; the number of bytes, or None (then the buffer's
        content is undefined). BufferTooSmallError when the block does not fit."""
        pair = (key, validate_key(key))
        sink = as_sink(buffer)
        strict = self._strict(strict)
        limit = self._tier_limit(max_tier)
        items = await self._read_or_fail([pair], into(sink), strict, limit, "get_into")
        if items is None or not self.settle(items[0], pair[0], strict):
            return None
        item = items[0]
        assert item is not None
        return int(item.entry.size_bytes)

    async def batch_get(
        self, keys: Sequence[str], *, strict: bool | None = None, max_tier: str | None = None
    ) -> list[bytes | None]:
        """Each key's bytes or None, in order: one Lookup (none for cached keys), one MGET per
        node. With strict, a failure of the whole call raises; per-key misses stay None."""
        pairs = validate_keys(keys)
        limit = self._tier_limit(max_tier)
        if not pairs:
            return []
        items = await self._read_or_fail(
            pairs, fresh_bytes, self._strict(strict), limit, "batch_get"
        )
        if items is None:
            return [None] * len(pairs)
        return [
            item.result() if hit and item is not None else None
            for item, hit in zip(items, self.settle_batch(items, pairs), strict=True)
        ]

    async def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[WritableBuffer],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[int | None]:
        """Read each key into its buffer (one per key, in order): each block's size or None.
        BufferTooSmallError when a block does not fit its buffer."""
        pairs = validate_keys(keys)
        sinks = batch_sinks(pairs, buffers)
        limit = self._tier_limit(max_tier)
        if not pairs:
            return []
        items = await self._read_or_fail(
            pairs, into_each(sinks), self._strict(strict), limit, "batch_get_into"
        )
        if items is None:
            return [None] * len(pairs)
        return [
            int(item.entry.size_bytes) if hit and item is not None else None
            for item, hit in zip(items, self.settle_batch(items, pairs), strict=True)
        ]

    async def exists(self, key: str, *, strict: bool | None = None) -> bool:
        """Whether the index has the key (the bytes are not checked)."""
        validate_key(key)
        response = await self._call_or_fail(
            "exists", lambda d: self._lookup([key], d), self._strict(strict)
        )
        return response is not None and bool(response.entries[0].found)

    async def sizes(self, keys: Sequence[str], *, strict: bool | None = None) -> list[int | None]:
        """Each key's block size in bytes as the index has it, or None where it has no such key
        (or on failure, unless strict): one Lookup, no bytes read."""
        pairs = validate_keys(keys)
        if not pairs:
            return []
        names = [k for k, _ in pairs]
        response = await self._call_or_fail(
            "sizes", lambda d: self._lookup(names, d), self._strict(strict)
        )
        if response is None:
            return [None] * len(pairs)
        return [int(e.size_bytes) if e.found else None for e in response.entries]

    async def remove(self, key: str, *, strict: bool | None = None) -> bool:
        """Remove the key from the index; True if it was there. Replicas are told to drop the
        bytes, best effort."""
        validate_key(key)
        removed = await self._call_or_fail(
            "remove", lambda d: self._remove([key], d), self._strict(strict)
        )
        return removed is not None and removed[0]

    async def pin(self, keys: Sequence[str], replicas: int = 1) -> list[bool]:
        """Pin keys at ``replicas`` copies (0: unpin): never evicted, kept at that count by the
        masters, recorded in the replicated index. Per key: True when pinned (unpinned), False
        when the index has no such key. Raises PinQuotaExceededError when the masters' pin
        quota would be exceeded (the keys that fit are pinned), and any other failure as its
        typed error: pinning is an explicit request, never a silent miss."""
        pairs = validate_keys(keys)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidArgumentError(f"replicas: expected an int >= 0, got {replicas!r}")
        if not pairs:
            return []
        request = master_pb2.PinRequest(
            request_id=os.urandom(16), keys=[k for k, _ in pairs], replicas=replicas
        )

        async def call(deadline: float) -> master_pb2.PinResponse:
            response: master_pb2.PinResponse = await self._masters.call(
                "Pin", request, deadline=deadline, leader_only=True
            )
            self.floor.raise_to(response.revision)
            return response

        response = await self._within_deadline("pin", call)
        statuses = list(response.statuses)
        over = [k for (k, _), s in zip(pairs, statuses, strict=True) if s == PIN_QUOTA]
        if over:
            raise PinQuotaExceededError(
                f"pin quota exceeded: {len(over)} of {len(pairs)} keys not pinned (first: "
                f"{over[0]!r}); pinned {response.pinned_bytes} of {response.quota_bytes} bytes "
                "(size x replicas); unpin some keys or raise the masters' pin_quota"
            )
        return [s == PIN_OK for s in statuses]

    async def prefix_match(
        self, keys: Sequence[str], *, strict: bool | None = None, fetch_entries: bool = True
    ) -> int:
        """How many leading keys of ``keys`` the index holds (0 on failure)."""
        names = validate_key_names(keys)
        if not names:
            return 0

        async def call(deadline: float) -> int:
            if fetch_entries and len(names) <= PREFIX_LOOKUP_MAX_KEYS:
                return leading_hits(await self._lookup(names, deadline))
            request = master_pb2.PrefixMatchRequest(keys=names, min_revision=self.floor.value)
            response = await self._masters.call("PrefixMatch", request, deadline=deadline)
            self.floor.raise_to(response.revision)
            return min(int(response.matched), len(names))

        matched = await self._call_or_fail("prefix_match", call, self._strict(strict))
        return matched or 0

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[BytesLike] | BytesLike]
    ) -> bytes:
        """The cached bytes, or ``compute()``'s (awaited if a coroutine), stored best effort.
        Exceptions of ``compute`` propagate; a failing store never raises. The get and the put
        each have their own deadline; the time ``compute`` takes is its own."""
        data = await self.get(key, strict=False)
        if data is not None:
            return data
        value = compute()
        if inspect.isawaitable(value):
            value = await value
        return await self.store_computed(key, value)

    async def store_computed(self, key: str, value: BytesLike) -> bytes:
        """The second half of get_or_compute: count the fallback, put best effort, return the
        value as bytes. Bad keys and values raise; store failures do not."""
        self._strict(False)  # refuses a closed client
        item = self.put_item(key, value)
        self._stats.fallback()
        await self._put_prepared([item], strict=False, single=True)
        return value if type(value) is bytes else bytes(item.payload)

    # --- failure policy -------------------------------------------------------------------

    def _tier_limit(self, max_tier: str | None) -> int:
        return tier_limit(self.config.max_tier if max_tier is None else max_tier)

    def _strict(self, strict: bool | None) -> bool:
        """The call's strictness; also refuses calls on a closed client, in every mode (using a
        closed client is a bug in the caller, not a failure of the cache)."""
        if self._closed:
            raise UnavailableError("this kvpool client is closed")
        return self.strict if strict is None else bool(strict)

    async def _within_deadline(self, op: str, fn: Callable[[float], Awaitable[T]]) -> T:
        """Run ``fn(deadline)`` under the call's deadline; every failure comes out typed."""
        if self._closed:
            raise UnavailableError("this kvpool client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        try:
            async with asyncio.timeout_at(deadline + DEADLINE_SLACK_S):
                return await fn(deadline)
        except KVPoolError:
            raise
        except TimeoutError:
            raise DeadlineExceededError(
                f"{op}: not done within timeout_s={self.config.timeout_s}"
            ) from None
        except OSError as e:
            raise UnavailableError(f"{op}: {e}") from e
        except Exception as e:
            self._log.exception("client_call_failed", op=op)
            raise InternalError(f"{op}: {type(e).__name__}: {e}") from e

    async def _call_or_fail(
        self, op: str, fn: Callable[[float], Awaitable[T]], strict: bool
    ) -> T | None:
        """``fn`` under the deadline; None on a cache failure unless strict."""
        try:
            return await self._within_deadline(op, fn)
        except InvalidArgumentError:
            raise
        except KVPoolError:
            if strict:
                raise
            return None

    async def _read_or_fail(
        self,
        pairs: list[tuple[str, bytes]],
        sink_for: SinkFactory,
        strict: bool,
        limit: int = 0,
        op: str = "get",
    ) -> list[ReadItem | None] | None:
        if not tracing.STATE.enabled:
            return await self._read_or_fail_untraced(pairs, sink_for, strict, limit)
        span, token = tracing.enter_span(
            f"kvpool.{op}", kind=SpanKind.CLIENT, attributes={"kvpool.keys": len(pairs)}
        )
        try:
            items = await self._read_or_fail_untraced(pairs, sink_for, strict, limit)
            if span.is_recording():
                span.set_attributes(read_attributes(items, "" if items else "unavailable"))
            return items
        finally:
            tracing.exit_span(span, token)

    async def _read_or_fail_untraced(
        self, pairs: list[tuple[str, bytes]], sink_for: SinkFactory, strict: bool, limit: int
    ) -> list[ReadItem | None] | None:
        try:
            return await self._within_deadline(
                "get", lambda d: self._read(pairs, sink_for, d, limit)
            )
        except InvalidArgumentError:
            raise
        except KVPoolError as e:
            self._stats.miss(_miss_reason(e), len(pairs))
            if strict:
                raise
            return None

    def settle(self, item: ReadItem | None, key: str, strict: bool) -> bool:
        """Count a read's outcome; True for a hit. Strict misses raise the typed error."""
        if item is None:
            self._stats.miss("absent")
            if strict:
                raise BlockMissError(f"{key!r} is not in the index", reason="absent")
            return False
        if item.ok:
            self._stats.hit()
            return True
        reason = item.reason
        self._stats.miss(reason)
        if reason == "checksum_mismatch":
            self._log.warning("block_checksum_mismatch", key=key[:128], reasons=item.reasons)
        if strict:
            raise item.error()
        return False

    def settle_batch(
        self, items: Sequence[ReadItem | None], pairs: Sequence[tuple[str, bytes]]
    ) -> list[bool]:
        """:meth:`settle` for a batch (never strict), hits counted at once."""
        out: list[bool] = []
        hits = 0
        for item, (key, _) in zip(items, pairs, strict=True):
            if item is not None and item.ok:
                hits += 1
                out.append(True)
            else:
                out.append(self.settle(item, key, strict=False))
        if hits:
            self._stats.hit(hits)
        return out

    # --- reads --------------------------------------------------------------------------------

    async def _lookup(self, keys: list[str], deadline: float) -> master_pb2.LookupResponse:
        request = master_pb2.LookupRequest(keys=keys, min_revision=self.floor.value)
        response: master_pb2.LookupResponse = await self._masters.call(
            "Lookup", request, deadline=deadline
        )
        self.lookup_answered(keys, response)
        return response

    def lookup_answered(self, keys: list[str], response: master_pb2.LookupResponse) -> None:
        """Check a Lookup answer and learn from it (ring version, revision floor, cache)."""
        if len(response.entries) != len(keys):
            raise InternalError(
                f"Lookup answered {len(response.entries)} entries for {len(keys)} keys"
            )
        for key, entry in zip(keys, response.entries, strict=True):
            answered = entry.key  # read once: each field read builds a new str
            if answered != key and answered and entry.found:
                raise InternalError(f"Lookup answered {answered!r} in the place of {key!r}")
        self._placement.observe_ring_version(response.ring_version)
        # Monotonic reads: never ask a master that has applied less than what we have seen.
        self.floor.raise_to(response.revision)
        if self.cache.enabled:
            self.cache.learn_members([MemberInfo.from_proto(m) for m in response.members])
            self.cache.store_many(keys, list(response.entries), response.revision)

    def member(self, member_id: int, live: dict[int, MemberInfo]) -> MemberInfo | None:
        return (
            live.get(member_id) or self.cache.member(member_id) or self._placement.member(member_id)
        )

    def read_flow(
        self,
        pairs: list[tuple[str, bytes]],
        sink_for: SinkFactory,
        deadline: float,
        limit: int,
        clock: Callable[[], float],
    ) -> ReadFlow:
        """:func:`~kvpool.client.ops.read_flow` over this client's cache and placement, for
        either driver (``clock``: the driver's)."""
        return read_flow(
            self.cache,
            self._placement,
            pairs,
            sink_for,
            limit=limit,
            deadline=deadline,
            clock=clock,
        )

    async def _read(
        self, pairs: list[tuple[str, bytes]], sink_for: SinkFactory, deadline: float, limit: int
    ) -> list[ReadItem | None]:
        """The event-loop driver of :func:`~kvpool.client.ops.read_flow`."""
        flow = self.read_flow(pairs, sink_for, deadline, limit, asyncio.get_running_loop().time)
        member = self.member
        answer: master_pb2.LookupResponse | None = None
        while True:
            try:
                step = flow.send(answer)
            except StopIteration as done:
                items: list[ReadItem | None] = done.value
                return items
            if isinstance(step, Lookup):
                answer = await self._lookup(step.keys, deadline)
            else:
                await self._data.read(
                    step.items,
                    partial(member, live=step.live),
                    deadline,
                    on_retry=self._stats.replica_retries,
                )
                answer = None

    # --- writes -------------------------------------------------------------------------------

    def put_item(self, key: str, value: object) -> PutItem:
        key_bytes = validate_key(key)
        payload = as_payload(value, self.config.max_value_size)
        return PutItem(key, key_bytes, payload)

    async def _put_prepared(
        self, items: list[PutItem], strict: bool, *, single: bool
    ) -> list[PutReceipt | None]:
        """The one put path: each item's receipt once committed, None where it failed."""
        receipts: dict[PutItem, PutReceipt] = {}
        try:
            await self._within_deadline("put", lambda d: self._put(items, d, receipts))
        except InvalidArgumentError:
            raise
        except KVPoolError:
            self._stats.puts(0, len(items))
            if strict:
                raise
            return [None] * len(items)
        return self.put_results(items, receipts, strict, single=single)

    def put_results(
        self,
        items: list[PutItem],
        receipts: dict[PutItem, PutReceipt],
        strict: bool,
        *,
        single: bool,
    ) -> list[PutReceipt | None]:
        results = [receipts.get(it) if it.committed else None for it in items]
        ok = sum(r is not None for r in results)
        self._stats.puts(ok, len(results) - ok)
        if single and strict and results[0] is None:
            raise items[0].error or UnavailableError(f"put {items[0].key!r} failed")
        return results

    def put_flow(
        self,
        items: list[PutItem],
        receipts: dict[PutItem, PutReceipt],
        deadline: float,
        clock: Callable[[], float],
    ) -> PutFlow:
        """:func:`~kvpool.client.ops.put_flow` over this client's placement and commit
        bookkeeping, for either driver (``clock``: the driver's)."""
        return put_flow(
            self._placement,
            items,
            receipts,
            self.commit_answered,
            replicas=self.config.replicas,
            timeout_s=self.config.timeout_s,
            deadline=deadline,
            max_commit_entries=MAX_COMMIT_ENTRIES,
            clock=clock,
        )

    async def _put(
        self, items: list[PutItem], deadline: float, receipts: dict[PutItem, PutReceipt]
    ) -> None:
        """The event-loop driver of :func:`~kvpool.client.ops.put_flow` (a commit's chunks go
        at once)."""
        flow = self.put_flow(items, receipts, deadline, asyncio.get_running_loop().time)
        answer: list[CommitAnswer | KVPoolError] | None = None
        while True:
            try:
                step = flow.send(answer)
            except StopIteration:
                return
            answer = None
            if isinstance(step, EnsureMembers):
                await self._ensure_members(deadline)
            elif isinstance(step, Stage):
                await self._data.stage(step.items, step.deadline)
            elif isinstance(step, Commit):
                answer = await self._commit_chunks(step.chunks, step.ring_version, deadline)
            elif isinstance(step, Publish):
                await self._data.publish(step.refs, deadline, wait=step.wait)
            else:
                await self._data.delete(step.refs, step.deadline)

    async def _commit_chunks(
        self, chunks: list[list[PutItem]], ring_version: int, deadline: float
    ) -> list[CommitAnswer | KVPoolError]:
        """Commit every chunk at once (each grouped with this client's other puts committing
        meanwhile): one outcome per chunk. An error that is not a KVPoolError is raised (the
        first chunk's error when every chunk failed)."""
        outcomes = await asyncio.gather(
            *(self._committer.commit(ring_version, put_entries(c), deadline) for c in chunks),
            return_exceptions=True,
        )
        answers: list[CommitAnswer | KVPoolError] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, KVPoolError):
                failures = [o for o in outcomes if isinstance(o, BaseException)]
                raise failures[0] if len(failures) == len(outcomes) else outcome
            answers.append(outcome)
        return answers

    async def _commit_rpc(
        self, request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        response: master_pb2.CommitPutsResponse = await self._masters.call(
            "CommitPuts", request, deadline=deadline, leader_only=True
        )
        return response

    def commit_answered(
        self, staged: list[PutItem], answer: CommitAnswer, receipts: dict[PutItem, PutReceipt]
    ) -> AfterCommit | None:
        """Learn from a commit's answer: receipts, errors, the floor, the cache; the blocks to
        publish and to delete, or None when the index refused the ring (StaleRingError on every
        item)."""
        if answer.stale_ring:
            self._placement.mark_stale(answer.ring_version)
            for it in staged:
                it.error = StaleRingError(
                    f"put {it.key!r}: the ring changed under the put",
                    ring_version=answer.ring_version,
                )
            return None
        self._placement.observe_ring_version(answer.ring_version)
        self.floor.raise_to(answer.revision)
        refs = judge_commit(staged, answer, receipts)
        if self.cache.enabled:
            for it, result in zip(staged, answer.results, strict=True):
                if it.committed:
                    self.cache.committed(it.key, committed_entry(it, result), answer.revision)
        deletes, wait = superseded(staged, answer.results, self._placement.member)
        return AfterCommit(refs, deletes, wait)

    async def _ensure_members(self, deadline: float) -> None:
        """Refresh the membership when the placement asks for it (one refresh at a time)."""
        if not self._placement.needs_refresh():
            return
        async with self._members_lock:
            loop = asyncio.get_running_loop()
            for attempt in range(EMPTY_RING_ASKS):
                if not self._placement.needs_refresh():
                    return
                if attempt:  # an empty ring: ask again (the next master in turn)
                    await asyncio.sleep(min(empty_ring_delay(attempt), deadline - loop.time()))
                    if loop.time() >= deadline:
                        return
                try:
                    response: master_pb2.GetMembersResponse = await self._masters.call(
                        "GetMembers", master_pb2.GetMembersRequest(), deadline=deadline
                    )
                except KVPoolError:
                    if self._placement.has_ring:
                        return  # place on the ring we have; the index refuses it if stale
                    raise
                self.members_answered(response, loop.time())
                if not self._placement.ring_is_empty():
                    return

    def members_answered(self, response: master_pb2.GetMembersResponse, now_s: float) -> None:
        self._placement.update(
            (MemberInfo.from_proto(m) for m in response.members), response.ring_version, now_s
        )
        self._stats.ring_refreshed()

    def _node_failed(self, member_id: int) -> None:
        self._placement.node_failed(member_id, asyncio.get_running_loop().time())

    def _node_slow(self, member_id: int) -> None:
        self._placement.node_slow(member_id, asyncio.get_running_loop().time())

    def _stats_hedged(self, sent: int, won: int) -> None:
        self._stats.hedged(sent, won)

    # --- remove -------------------------------------------------------------------------------

    async def _remove(self, keys: list[str], deadline: float) -> list[bool]:
        request = master_pb2.RemoveRequest(request_id=os.urandom(16), keys=keys)
        response: master_pb2.RemoveResponse = await self._masters.call(
            "Remove", request, deadline=deadline, leader_only=True
        )
        if len(response.removed) != len(keys):
            raise InternalError(
                f"Remove answered {len(response.removed)} results for {len(keys)} keys"
            )
        self.floor.raise_to(response.revision)
        for key in keys:
            self.cache.removed(key, response.revision)
        live = {m.member_id: MemberInfo.from_proto(m) for m in response.members}
        refs = []
        for block in response.blocks:
            for member_id in block.replicas:
                member = live.get(member_id) or self._placement.member(member_id)
                if member is not None:
                    refs.append(BlockRef(block.key.encode("utf-8"), block.write_id, 0, member))
        if refs:
            loop = asyncio.get_running_loop()
            await self._data.delete(refs, min(deadline, loop.time() + DELETE_WAIT_S))
        return list(response.removed)


# --- where read bytes go -------------------------------------------------------------------------


def fresh_bytes(_index: int, _key: str, _size: int) -> tuple[memoryview | None, bool]:
    """Into new bytes (get, batch_get)."""
    return None, False


def into(sink: memoryview) -> SinkFactory:
    """Into the caller's buffer (get_into): BufferTooSmallError when the block does not fit."""

    def caller(_index: int, key: str, size: int) -> tuple[memoryview | None, bool]:
        check_fits(sink, size, key)
        return sink[:size], True

    return caller


def batch_sinks(pairs: list[tuple[str, bytes]], buffers: Sequence[object]) -> list[memoryview]:
    if isinstance(buffers, str | bytes) or not isinstance(buffers, Sequence):
        raise InvalidArgumentError("batch_get_into takes a sequence of buffers, one per key")
    if len(buffers) != len(pairs):
        raise InvalidArgumentError(
            f"batch_get_into: {len(pairs)} keys but {len(buffers)} buffers (one per key)"
        )
    return [as_sink(b) for b in buffers]


def into_each(sinks: list[memoryview]) -> SinkFactory:
    """Into each key's own buffer (batch_get_into)."""

    def caller(index: int, key: str, size: int) -> tuple[memoryview | None, bool]:
        sink = sinks[index]
        check_fits(sink, size, key)
        return sink[:size], True

    return caller
