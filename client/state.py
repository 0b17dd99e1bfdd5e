"""What a client knows and decides, with no I/O: one :class:`ClientState` under both drivers.

A client is this state plus a driver that carries out its requests:
:class:`~kvpool.client.fastpath.SyncPath` with blocking sockets in the caller's thread (the
synchronous :class:`~kvpool.client.sync.Client`), and :class:`~kvpool.client.core.ClientCore`
on an event loop (:class:`~kvpool.client.aio.AsyncClient`). The state holds the placement, the
lookup cache, the read-your-writes floor, the counters and the master routing, and writes every
operation once (:mod:`kvpool.client.api` builds them, each a :class:`Job`):

* a read is a :class:`ReadCall` — the keys, where their bytes go, the call's strictness and
  tier limit, and how its answer is made from the read items; the read itself is
  :func:`~kvpool.client.ops.read_flow`;
* a put is a :class:`PutCall`: :func:`~kvpool.client.ops.put_flow` over
  :meth:`ClientState.commit_answered`;
* a question to the index or a change of it (exists, sizes, locate, batch_exists,
  prefix_match, pin, remove) is a :class:`Query` — the master method and request, how the
  answer is read (a value, or the next Query), and the neutral answer on failure.

Failure policy, in one place: bad input raises the typed caller error in every mode; a failure
of the cache (no master, node down, timeout, checksum mismatch, miss) returns the call's
neutral answer (None, False, 0) and is counted in :attr:`ClientState.stats`, or, with
``strict``, raises the typed error. Every call runs under one deadline of ``timeout_s``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from opentelemetry.trace import SpanKind

from kvpool import tracing
from kvpool.client.blocks import BlockRef, PutItem, ReadItem
from kvpool.client.cache import LookupCache
from kvpool.client.client_metrics import ClientMetrics
from kvpool.client.commits import (
    AfterCommit,
    CommitAnswer,
    PutReceipt,
    committed_entry,
    judge_commit,
    superseded,
)
from kvpool.client.hedge import HedgePolicy
from kvpool.client.links import Links
from kvpool.client.ops import (
    DELETE_WAIT_S,
    Ask,
    CommitOutcomes,
    Connect,
    Delete,
    Pause,
    PutStep,
    ReadFlow,
    SinkFactory,
    Step,
    put_flow,
    read_flow,
)
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.spans import read_attributes
from kvpool.client.stats import ClientStats
from kvpool.client.values import (
    BytesLike,
    PutItems,
    as_value,
    put_items,
    validate_key,
)
from kvpool.config import ClientConfig
from kvpool.errors import (
    BlockMissError,
    ConfigError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KVPoolError,
    StaleRingError,
    UnavailableError,
)
from kvpool.logs import get_logger
from kvpool.mastercall import MasterRouting
from kvpool.proto.keys import is_scheme_key
from kvpool.proto.v1 import master_pb2

__all__ = [
    "Answered",
    "ClientState",
    "Job",
    "PutCall",
    "PutReceipt",
    "Query",
    "ReadCall",
    "RevisionFloor",
    "WarmUpCall",
    "tier_limit",
]

T = TypeVar("T")
R = TypeVar("R")

MAX_COMMIT_ENTRIES = 8192
"""Most entries in one CommitPuts (the masters' default commit_batch_max_entries); a larger
batch_put commits in several calls."""
EMPTY_RING_ASKS = 4
"""How many times a put asks for the membership while the answer names no node that takes
puts: right after a cluster starts a follower may answer before it has applied the nodes'
registrations (GetMembers is answered by any master); the masters are asked in turn."""


def empty_ring_delay(attempt: int) -> float:
    """The pause before asking again for the membership after an empty answer."""
    return 0.02 * attempt


MASTER_ATTEMPT_S = 0.5
"""The longest one call waits for one master before asking another: a paused leader costs a
writer this long (a new leader is elected within ~0.3-0.7 s; a retried commit applies once)."""

TIER_LIMITS: dict[str, int] = {"": 0, "any": 0, "gpu": 1, "cpu": 2, "ssd": 3}
"""``max_tier`` names: the slowest tier a get accepts (a block held only on a slower one is a
miss, ``slow_tier``, without reading it)."""


def _every_key(_key: str) -> bool:
    return True


DIRECT_KEYS: dict[str, Callable[[str], bool] | None] = {
    "scheme": is_scheme_key,
    "all": _every_key,
    "off": None,
}
"""``direct_reads``: which keys name their content (read with no Lookup first)."""


def tier_limit(max_tier: str) -> int:
    """The TierLevel for a ``max_tier`` name; InvalidArgumentError for an unknown one."""
    try:
        return TIER_LIMITS[max_tier.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgumentError(
            f"max_tier: expected one of gpu, cpu, ssd or any, got {max_tier!r}"
        ) from None


def miss_reason(error: KVPoolError) -> str:
    return "timeout" if isinstance(error, DeadlineExceededError) else "unavailable"


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


# --- what the drivers carry out -------------------------------------------------------------------


Clock = Callable[[], float]


class Job(Generic[R]):
    """One public call, built and not yet carried out (:mod:`kvpool.client.api` builds one per
    call). A driver's ``carry(job)`` answers ``finish(state, None)`` at once when the job is
    ``idle()``; else it runs ``flow(state, deadline, clock)`` under the failure policy
    ``attempt(state)`` and the deadline ``timeout_s`` (else the client's), and answers
    ``finish(state, value)`` of what the flow answered, or of the attempt's neutral answer
    after a failure. Each kind of call — a :class:`ReadCall`, a :class:`Query`, a
    :class:`PutCall`, a :class:`WarmUpCall` — says how, once for both drivers."""

    __slots__ = ()
    timeout_s: float | None = None

    def idle(self) -> bool:
        return False

    def flow(self, state: ClientState, deadline: float, clock: Clock) -> Generator[Step, Any, Any]:
        raise NotImplementedError

    def attempt(self, state: ClientState) -> Attempt:
        raise NotImplementedError

    def finish(self, state: ClientState, value: Any) -> R:
        result: R = value
        return result


@dataclass(slots=True)
class ReadCall(Job[Any]):
    """One read operation: read ``pairs`` (key, key bytes) into where ``sink_for`` says; the
    caller's answer is :meth:`ClientState.answer` of the items read — ``value(index, item)``
    for each hit, None for a miss, one answer for a ``single``-key call (get, get_into), a list
    otherwise. (Slotted, not a NamedTuple or frozen: one is built for every get, and this is the
    cheapest of the three to build.)"""

    op: str
    pairs: list[tuple[str, bytes]]
    sink_for: SinkFactory
    strict: bool
    limit: int
    value: Callable[[int, ReadItem], Any]
    single: bool = False
    direct: bool = True  # its sinks take a size not known yet (ops.DIRECT_SIZE)

    def idle(self) -> bool:
        return not self.pairs

    def flow(self, state: ClientState, deadline: float, clock: Clock) -> ReadFlow:
        return state.read_flow(self, deadline, clock)

    def attempt(self, state: ClientState) -> Attempt:
        return state.reading(self)

    def finish(self, state: ClientState, value: Any) -> Any:
        return state.answer(self, value)


@dataclass(frozen=True, slots=True)
class Query(Job[T]):
    """One call to a master: ``answered(response)`` is the caller's answer, the next Query to
    ask (within the same deadline), or :class:`Removed`. On a failure of the cache the answer is
    ``neutral`` unless ``strict`` (then the typed error)."""

    op: str
    method: str
    request: Any
    answered: Callable[[Any], Any]
    neutral: T
    strict: bool
    leader_only: bool = False

    def flow(self, state: ClientState, deadline: float, clock: Clock) -> Generator[Step, Any, Any]:
        return state.ask_flow(self, deadline, clock)

    def attempt(self, state: ClientState) -> Attempt:
        return state.asking(self)


@dataclass(frozen=True, slots=True)
class Answered(Job[T]):
    """A call answered without asking anyone (an empty batch)."""

    value: T

    def idle(self) -> bool:
        return True

    def finish(self, state: ClientState, value: Any) -> T:
        return self.value


@dataclass(slots=True)
class PutCall(Job[R]):
    """A put of ``items`` (one commit): the caller's answer is ``answers(receipts)``, each
    item's receipt once committed or None where it failed."""

    items: list[PutItem]
    strict: bool
    single: bool
    answers: Callable[[list[PutReceipt | None]], R]
    receipts: dict[PutItem, PutReceipt] = field(default_factory=dict)

    def idle(self) -> bool:
        return not self.items

    def flow(self, state: ClientState, deadline: float, clock: Clock) -> Generator[Step, Any, Any]:
        return state.put_flow(self.items, self.receipts, deadline, clock)

    def attempt(self, state: ClientState) -> Attempt:
        return state.putting(self.items, self.strict)

    def finish(self, state: ClientState, value: Any) -> R:
        done = bool(value)
        results = state.put_results(
            self.items, self.receipts, self.strict, done, single=self.single
        )
        return self.answers(results)


@dataclass(frozen=True, slots=True)
class WarmUpCall(Job["WarmUp"]):
    """A warm-up (``warm_up``): see :meth:`ClientState.warm_up_flow`."""

    nodes: bool
    timeout_s: float | None

    def flow(self, state: ClientState, deadline: float, clock: Clock) -> Generator[Step, Any, Any]:
        return state.warm_up_flow(self.nodes, deadline, clock)

    def attempt(self, state: ClientState) -> Attempt:
        return state.warming_up()

    def finish(self, state: ClientState, value: Any) -> WarmUp:
        return state.warmed(value)


WARM_UP_LOOKUP = master_pb2.LookupRequest(keys=["kvpool/warm-up"], internal=True)
"""A warm-up's lookup: it finds the leader (lookups and commits go there); ``internal``: not
counted as an engine's read."""


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What ``warm_up`` opened: a call to a master (``masters``: "" once one answered and the
    ring is loaded, else why none did) and a data connection to every node of the ring
    (``nodes``: node id -> "" when open, else why not). Nothing in it is needed later: a call
    opens what is missing, so a failed warm-up costs only the first calls' time."""

    masters: str
    nodes: dict[str, str]
    elapsed_s: float

    @staticmethod
    def why(error: KVPoolError) -> str:
        """How a failure reads in a warm-up's answer."""
        return f"{type(error).__name__}: {error.message}"

    @property
    def ok(self) -> bool:
        """A master answered and every node's connection is open."""
        return not self.masters and not any(self.nodes.values())

    def summary(self) -> str:
        """One line for a log."""
        if self.masters:
            return f"no master answered in {self.elapsed_s:.3f}s: {self.masters}"
        if not self.nodes:
            return f"a master answered in {self.elapsed_s:.3f}s; no node connection opened"
        failed = {n: why for n, why in self.nodes.items() if why}
        text = f"{len(self.nodes) - len(failed)} of {len(self.nodes)} node(s) connected"
        text += f" in {self.elapsed_s:.3f}s"
        return text + "".join(f"; {n}: {why}" for n, why in sorted(failed.items()))


class Removed(NamedTuple):
    """A remove's answer, once the replicas named in ``refs`` have been told to drop the bytes
    (best effort, within DELETE_WAIT_S)."""

    value: Any
    refs: list[BlockRef]


class Attempt:
    """The failure policy around one call, for either driver::

        with state.reading(call) as read:
            read.value = <carry the call out>       # blocking or awaited
        return state.answer(call, read.value)

    A failure of the cache (a KVPoolError; any other error is made one by ``typed``, when
    given) leaves ``value`` at the call's neutral answer — counted (``on_failure``) and recorded
    on the call's span — unless the call is strict; caller errors (InvalidArgumentError) and
    strict failures propagate. The span (``kvpool.<op>``, when tracing and ``span_keys`` is
    given) is entered and ended here."""

    __slots__ = (
        "_on_failure",
        "_on_success",
        "_op",
        "_span",
        "_strict",
        "_token",
        "_typed",
        "value",
    )

    def __init__(  # noqa: PLR0917 - positional: one is built for every call
        self,
        op: str,
        neutral: Any,
        strict: bool,
        typed: Callable[[str, Exception], KVPoolError] | None = None,
        on_failure: Callable[[KVPoolError, Any], None] | None = None,
        span_keys: int | None = None,
        on_success: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.value = neutral
        self._op = op
        self._strict = strict
        self._typed = typed
        self._on_failure = on_failure
        self._on_success = on_success
        self._span: Any = None
        self._token: object = None
        if span_keys is not None and tracing.STATE.enabled:
            self._span, self._token = tracing.enter_span(
                f"kvpool.{op}", kind=SpanKind.CLIENT, attributes={"kvpool.keys": span_keys}
            )

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, _kind: object, error: BaseException | None, _tb: object) -> bool:
        span = self._span
        try:
            if error is None:
                if span is not None and self._on_success is not None and span.is_recording():
                    self._on_success(self.value, span)
                return False
            if isinstance(error, KVPoolError):
                if isinstance(error, InvalidArgumentError):
                    return False
                failure = error
            elif self._typed is not None and isinstance(error, Exception):
                failure = self._typed(self._op, error)
            else:
                return False
            if self._on_failure is not None:
                self._on_failure(failure, span)
            if self._strict and failure is not error:
                raise failure from error
            return not self._strict
        finally:
            if span is not None:
                tracing.exit_span(span, self._token)


NO_SPAN = nullcontext()
"""What :meth:`ClientState.looking_up` is when tracing is off (shared: it holds nothing)."""


def _read_done(items: list[ReadItem | None] | None, span: Any) -> None:
    span.set_attributes(read_attributes(items))


class ClientState:
    """A client's knowledge and decisions (see the module doc); the drivers subclass it."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        strict: bool = False,
        logger: Any = None,
        routing: MasterRouting | None = None,
    ) -> None:
        if not isinstance(strict, bool):
            raise ConfigError(f"strict: expected True or False, got {strict!r}")
        self.config = config
        self.strict = strict
        self._log = logger if logger is not None else get_logger("kvpool.client")
        tracing.setup_client_tracing()
        self.attempt_timeout_s = min(MASTER_ATTEMPT_S, config.timeout_s)
        self.security = config.security()
        self.routing = routing or MasterRouting(config.masters)
        self.links = Links(config.transport)
        self.hedge_policy = HedgePolicy(config.hedge_reads, config.hedge_delay_ms / 1000)
        self._stats = ClientStats()
        self._placement = Placement(
            retry_s=config.node_retry_ms / 1000,
            is_local=self.links.is_local,
            on_hold=self._stats.node_held,
        )
        self.cache = LookupCache(config.lookup_cache_size, config.lookup_cache_ttl_s)
        self.floor = RevisionFloor()
        self.metrics = ClientMetrics(self._stats)
        self._closed = False
        self._default_limit = tier_limit(config.max_tier)
        self.direct_keys = DIRECT_KEYS[config.direct_reads]

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
    def closed(self) -> bool:
        return self._closed

    def mark_closed(self) -> None:
        """Refuse further calls."""
        self._closed = True

    # --- failure policy -------------------------------------------------------------------

    def read_limit(self, max_tier: str | None) -> int:
        """The slowest tier a read accepts (``max_tier``, else the client's)."""
        return self._default_limit if max_tier is None else tier_limit(max_tier)

    def strictness(self, strict: bool | None) -> bool:
        """The call's strictness; also refuses calls on a closed client, in every mode (using a
        closed client is a bug in the caller, not a failure of the cache)."""
        if self._closed:
            raise UnavailableError("this kvpool client is closed")
        return self.strict if strict is None else bool(strict)

    def call_deadline(self, now: float, timeout_s: float | None = None) -> float:
        """When a call starting ``now`` must be done (``timeout_s``, else the client's);
        UnavailableError on a closed client."""
        if self._closed:
            raise UnavailableError("this kvpool client is closed")
        return now + (self.config.timeout_s if timeout_s is None else timeout_s)

    def call_error(self, op: str, error: Exception) -> KVPoolError:
        """The typed error for what a call under its deadline raised."""
        if isinstance(error, KVPoolError):
            return error
        if isinstance(error, TimeoutError):
            return DeadlineExceededError(f"{op}: not done within timeout_s={self.config.timeout_s}")
        if isinstance(error, OSError):
            return UnavailableError(f"{op}: {error}")
        self._log.exception("client_call_failed", op=op)  # called while handling ``error``
        return InternalError(f"{op}: {type(error).__name__}: {error}")

    def asking(self, query: Query[Any]) -> Attempt:
        """The failure policy of a :class:`Query`: its neutral answer unless strict."""
        return Attempt(query.op, query.neutral, query.strict, self.call_error)

    # --- reads ----------------------------------------------------------------------------

    def answer(self, call: ReadCall, items: list[ReadItem | None] | None) -> Any:
        """The caller's answer to ``call`` from the items read (None: the read failed as a
        whole): each outcome counted, a strict single-key miss raised as its typed error."""
        if call.single:
            if items is None:
                return None
            item = items[0]
            if item is not None and item.ok:  # a hit (the common case: settle() inlined)
                self._stats.hit()
                return call.value(0, item)
            self.settle(item, call.pairs[0][0], call.strict)
            return None
        if items is None:
            return [None] * len(call.pairs)
        hits = self.settle_batch(items, call.pairs)
        value = call.value
        return [
            value(i, item) if hit and item is not None else None
            for i, (item, hit) in enumerate(zip(items, hits, strict=True))
        ]

    def reading(self, call: ReadCall) -> Attempt:
        """The failure policy of a read (see :class:`Attempt`): a read that failed as a whole
        is counted as a miss of every key, and its answer is ``answer(call, None)``."""
        n = len(call.pairs)

        def failed(error: KVPoolError, span: Any) -> None:
            self._stats.miss(miss_reason(error), n)
            if span is not None and span.is_recording():
                span.set_attributes(read_attributes(None, miss_reason(error)))

        return Attempt(call.op, None, call.strict, self.call_error, failed, n, _read_done)

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

    def read_flow(self, call: ReadCall, deadline: float, clock: Callable[[], float]) -> ReadFlow:
        """:func:`~kvpool.client.ops.read_flow` of ``call`` over this client's cache and
        placement, for either driver (``clock``: the driver's); the keys that name their
        content are read without a Lookup when the call allows it (``direct_reads``)."""
        return read_flow(
            self.cache,
            self._placement,
            call.pairs,
            call.sink_for,
            limit=call.limit,
            deadline=deadline,
            clock=clock,
            direct=self.direct_keys if call.direct else None,
            on_direct=self._stats.direct,
            direct_replicas=self.config.replicas,
        )

    # --- index questions ------------------------------------------------------------------

    def lookup_request(self, names: list[str]) -> master_pb2.LookupRequest:
        """A Lookup of ``names`` from a master that has applied all this client has seen."""
        return master_pb2.LookupRequest(keys=names, min_revision=self.floor.value)

    def lookup_query(
        self,
        op: str,
        names: list[str],
        answered: Callable[[master_pb2.LookupResponse], Any],
        neutral: Any,
        strict: bool,
    ) -> Query[Any]:
        request = self.lookup_request(names)

        def learn(response: master_pb2.LookupResponse) -> Any:
            self.lookup_answered(names, response)
            return answered(response)

        return Query(op, "Lookup", request, learn, neutral, strict)

    def remove_query(
        self,
        op: str,
        keys: list[str],
        strict: bool,
        neutral: Any,
        answer: Callable[[master_pb2.RemoveResponse], Any],
        *,
        prefixes: tuple[str, ...] = (),
        limit: int = 0,
    ) -> Query[Any]:
        """Remove keys (or every key under ``prefixes``, at most ``limit``) in one commit; the
        replicas the index named are told to drop the bytes."""
        request = master_pb2.RemoveRequest(
            request_id=os.urandom(16), keys=keys, prefixes=prefixes, limit=limit
        )

        def removed(response: master_pb2.RemoveResponse) -> Removed:
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
                if prefixes:
                    self.cache.removed(block.key, response.revision)
                for member_id in block.replicas:
                    member = live.get(member_id) or self._placement.member(member_id)
                    if member is not None:
                        refs.append(BlockRef(block.key.encode("utf-8"), block.write_id, 0, member))
            return Removed(answer(response), refs)

        return Query(op, "Remove", request, removed, neutral, strict, leader_only=True)

    def put_item(self, key: str, value: object) -> PutItem:
        key_bytes = validate_key(key)
        payload = as_value(value, self.config.max_value_size)
        return PutItem(key, key_bytes, payload)

    def put_items(self, items: PutItems) -> list[PutItem]:
        return [self.put_item(k, v) for k, v in put_items(items)]

    def computed_item(self, key: str, value: BytesLike) -> PutItem:
        """get_or_compute's put: bad keys and values raise; its failure never does."""
        self.strictness(False)  # refuses a closed client
        item = self.put_item(key, value)
        self._stats.fallback()
        return item

    def putting(self, items: list[PutItem], strict: bool) -> Attempt:
        """The failure policy of a put: one that failed as a whole counts every item failed
        and leaves ``value`` False (strict: the error)."""

        def failed(_error: KVPoolError, _span: Any) -> None:
            self._stats.puts(0, len(items))

        return Attempt("put", False, strict, self.call_error, failed)

    def put_results(
        self,
        items: list[PutItem],
        receipts: dict[PutItem, PutReceipt],
        strict: bool,
        done: bool,
        *,
        single: bool,
    ) -> list[PutReceipt | None]:
        """Each item's receipt, None where it failed (all None: the put was not ``done``)."""
        if not done:
            return [None] * len(items)
        results = [receipts.get(it) if it.committed else None for it in items]
        ok = sum(r is not None for r in results)
        self._stats.puts(ok, len(results) - ok)
        if single and strict and results[0] is None:
            raise items[0].error or UnavailableError(f"put {items[0].key!r} failed")
        return results

    def computed_job(self, key: str, value: BytesLike) -> Job[bytes]:
        """get_or_compute's put of ``value`` (best effort: bad keys and values raise, a failing
        store does not), answering the value as bytes."""
        item = self.computed_item(key, value)
        answer = value if type(value) is bytes else bytes(item.payload)
        return PutCall([item], False, True, lambda _receipts: answer)

    def put_flow(
        self,
        items: list[PutItem],
        receipts: dict[PutItem, PutReceipt],
        deadline: float,
        clock: Callable[[], float],
    ) -> Generator[PutStep, CommitOutcomes | None, bool]:
        """:func:`~kvpool.client.ops.put_flow` over this client's placement and commit
        bookkeeping, for either driver (``clock``: the driver's); True once done."""
        yield from put_flow(
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
        return True

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

    # --- the other flows: a master's questions, the membership, a warm-up -----------------

    def ask_flow(
        self, query: Query[Any], deadline: float, clock: Callable[[], float]
    ) -> Generator[Step, Any, Any]:
        """A :class:`Query` asked, and the ones its answers ask for; a :class:`Removed`'s
        replicas told to drop the bytes (best effort, DELETE_WAIT_S at most)."""
        step: Any = query
        while isinstance(step, Query):
            answer = yield Ask(step.method, step.request, step.leader_only)
            step = step.answered(answer)
        if isinstance(step, Removed):
            if step.refs:
                yield Delete(step.refs, min(deadline, clock() + DELETE_WAIT_S))
            return step.value
        return step

    def members_flow(
        self, patient: bool, deadline: float, clock: Callable[[], float]
    ) -> Generator[Step, Any, None]:
        """A refresh of the membership (the driver's :class:`~kvpool.client.ops.EnsureMembers`,
        when the placement asks for one; one patient refresh at a time). Not ``patient`` (a
        read's): one ask, and a failure is no error. ``patient`` (a put's): asked again, of the
        next master in turn, while the answer names no node; a failure raises only when there
        is no ring at all."""
        placement = self._placement
        if not patient:
            placement.refresh_tried(clock())
            try:
                answer = yield Ask("GetMembers", master_pb2.GetMembersRequest())
            except KVPoolError:
                return
            self.members_answered(answer, clock())
            return
        for attempt in range(EMPTY_RING_ASKS):
            if not placement.needs_refresh():
                return
            if attempt:  # an empty ring: ask again
                left = deadline - clock()
                if left <= 0:
                    return
                yield Pause(min(empty_ring_delay(attempt), left))
            try:
                answer = yield Ask("GetMembers", master_pb2.GetMembersRequest())
            except KVPoolError:
                if placement.has_ring:
                    return  # place on the ring we have; the index refuses it if stale
                raise
            self.members_answered(answer, clock())
            if not placement.ring_is_empty():
                return

    def warm_up_flow(
        self, nodes: bool, _deadline: float, clock: Callable[[], float]
    ) -> Generator[Step, Any, WarmUp]:
        """A warm-up (``warm_up``): the leader asked (lookups and commits go there; its RPC
        port is found too), then the ring, then (``nodes``) a connection opened to every node.
        Never fails for the cluster's state: the answer says what could not be opened."""
        start = clock()
        try:
            yield Ask("Lookup", WARM_UP_LOOKUP)
            answer = yield Ask("GetMembers", master_pb2.GetMembersRequest())
        except KVPoolError as e:
            return WarmUp(WarmUp.why(e), {}, clock() - start)
        self.members_answered(answer, clock())
        opened: dict[str, str] = (yield Connect(self._placement.members)) if nodes else {}
        return WarmUp("", opened, clock() - start)

    def warming_up(self) -> Attempt:
        """The failure policy of a warm-up: every failure raises, typed (its flow answers
        the cluster's)."""
        return Attempt("warm_up", None, True, self.call_error)

    def warmed(self, warm: WarmUp) -> WarmUp:
        """After a warm-up: the blocking driver lends this thread's connections to the next
        thread."""
        return warm

    def looking_up(self, keys: list[str]) -> AbstractContextManager[Any]:
        """Around a Lookup: its span (``kvpool.client.lookup``, when tracing); failures
        propagate."""
        if tracing.STATE.enabled:
            return Attempt("client.lookup", None, True, None, None, len(keys))
        return NO_SPAN

    def members_answered(self, response: master_pb2.GetMembersResponse, now_s: float) -> None:
        self._placement.update(
            (MemberInfo.from_proto(m) for m in response.members), response.ring_version, now_s
        )
        self._stats.ring_refreshed()
