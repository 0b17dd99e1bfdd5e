"""The client's public operations, each written once: ``Client`` and ``AsyncClient`` share
these signatures, checks and documents.

Each function builds its call as a :class:`~kvpool.client.state.Job` (the flow to run, its
failure policy, how its answer is made) and carries nothing out. A driver turns it into a
method: :func:`kvpool.client.fastpath.blocking` runs the job in the caller's thread and
answers the value (``Client``); :func:`kvpool.client.core.awaiting` makes a coroutine of it
(``AsyncClient``). Bad keys, values and buffers raise while the job is built, in every mode.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.buffers import Parts
from kvpool.client.commits import PutReceipt
from kvpool.client.ops import DIRECT_SIZE, SinkFactory, members_of
from kvpool.client.plans import BlockLocation, ReadItem
from kvpool.client.state import (
    Answered,
    ClientState,
    Job,
    PutCall,
    Query,
    ReadCall,
    WarmUp,
    WarmUpCall,
)
from kvpool.client.values import (
    Into,
    PutItems,
    Value,
    as_into,
    as_sink,
    check_fits,
    validate_key,
    validate_key_names,
    validate_keys,
)
from kvpool.errors import InternalError, InvalidArgumentError, PinQuotaExceededError
from kvpool.proto.v1 import master_pb2

T = TypeVar("T")

PREFIX_LOOKUP_MAX_KEYS = 1024
"""prefix_match of at most this many keys is a Lookup (entries cached for the reads that follow)
unless the caller asks for a count only; a longer chain asks PrefixMatch, which answers a count
only."""
PIN_OK = master_pb2.PIN_STATUS_OK
PIN_QUOTA = master_pb2.PIN_STATUS_QUOTA_EXCEEDED

__all__ = [
    "batch_exists",
    "batch_get",
    "batch_get_alloc",
    "batch_get_into",
    "batch_put",
    "batch_put_receipts",
    "batch_remove",
    "exists",
    "get",
    "get_into",
    "locate",
    "pin",
    "prefix_match",
    "put",
    "put_receipt",
    "remove",
    "remove_prefix",
    "sizes",
    "unpin",
    "warm_up",
]


def warm_up(
    client: ClientState, /, timeout_s: float | None = None, *, nodes: bool = True
) -> Job[WarmUp]:
    """Open now what the first calls would otherwise pay for (tens of milliseconds on a
    fresh client): the masters' channel and RPC connection, the ring, and (``nodes``) a
    connection to every node — the node's shared memory mapped where it offers it; a
    client that only asks the index (a scheduler's prefix matches) wants ``nodes=False``.
    In a ``Client``, another thread's first call takes these connections over. Never raises
    for the cluster's state (the answer says what could not be opened, within ``timeout_s``,
    default the client's); UnavailableError once the client is closed."""
    return WarmUpCall(nodes, timeout_s)


def put(client: ClientState, /, key: str, value: Value, *, strict: bool | None = None) -> Job[bool]:
    """Store ``value`` under ``key``: True once committed; False on failure (strict raises).

    ``value``: bytes, bytearray, C-contiguous memoryview or numpy array (sent as its raw
    bytes), or a list or tuple of them: one block, their bytes joined, each piece sent
    from where it is (no gathering copy). Do not modify it until put returns."""
    item = client.put_item(key, value)
    return PutCall([item], client.strictness(strict), True, _first_committed)


def put_receipt(
    client: ClientState, /, key: str, value: Value, *, strict: bool | None = None
) -> Job[PutReceipt | None]:
    """As :meth:`put`, answering the commit's receipt (version, write id, index revision,
    replica node ids) instead of True; None on failure (strict raises as put does)."""
    item = client.put_item(key, value)
    return PutCall([item], client.strictness(strict), True, _first)


def batch_put(
    client: ClientState, /, items: PutItems, *, strict: bool | None = None
) -> Job[list[bool]]:
    """Store many blocks with one commit; one bool per item, in order. With strict, a failure
    of the whole call raises; per-item failures stay False."""
    prepared = client.put_items(items)
    return PutCall(prepared, client.strictness(strict), False, _each_committed)


def batch_put_receipts(
    client: ClientState, /, items: PutItems, *, strict: bool | None = None
) -> Job[list[PutReceipt | None]]:
    """As :meth:`batch_put`, with each committed item's receipt (None where it failed)."""
    prepared = client.put_items(items)
    return PutCall(prepared, client.strictness(strict), False, _same)


def get(
    client: ClientState, /, key: str, *, strict: bool | None = None, max_tier: str | None = None
) -> Job[bytes | None]:
    """The bytes stored under ``key``, or None on a miss or any failure (strict raises
    BlockMissError, ChecksumMismatchError, DeadlineExceededError, UnavailableError…).
    ``max_tier`` ("gpu", "cpu", "ssd"; default: the config's): a block held only on a slower
    tier is a miss — for an engine that recomputes faster than it reads the SSD."""
    pair = (key, validate_key(key))
    strict_, limit = client.strictness(strict), client.read_limit(max_tier)
    return ReadCall("get", [pair], _fresh_bytes, strict_, limit, _result, True)


def get_into(
    client: ClientState,
    /,
    key: str,
    buffer: Into,
    *,
    strict: bool | None = None,
    max_tier: str | None = None,
) -> Job[int | None]:
    """Read the block straight into ``buffer`` (writable, C-contiguous, large enough, else
    BufferTooSmallError / InvalidValueError), or into a list or tuple of such buffers,
    filled in order: its size in bytes, or None (the buffer's content is then undefined).
    The bytes are copied once, into ``buffer``."""
    pair = (key, validate_key(key))
    sink = as_into(buffer)
    strict_, limit = client.strictness(strict), client.read_limit(max_tier)
    return ReadCall("get_into", [pair], _into_each([sink]), strict_, limit, _size, True)


def batch_get(
    client: ClientState,
    /,
    keys: Sequence[str],
    *,
    strict: bool | None = None,
    max_tier: str | None = None,
) -> Job[list[bytes | None]]:
    """Each key's bytes or None, in order (one lookup for the keys not cached, one MGET per
    node). With strict, a failure of the whole call raises; per-key misses stay None."""
    pairs = validate_keys(keys)
    strict_, limit = client.strictness(strict), client.read_limit(max_tier)
    return ReadCall("batch_get", pairs, _fresh_bytes, strict_, limit, _result)


def batch_get_into(
    client: ClientState,
    /,
    keys: Sequence[str],
    buffers: Sequence[Into],
    *,
    strict: bool | None = None,
    max_tier: str | None = None,
) -> Job[list[int | None]]:
    """Read each key into its own buffer (``buffers[i]`` for ``keys[i]``): each block's size
    or None. The bytes are copied once, into the buffers; BufferTooSmallError when a block
    does not fit its buffer."""
    pairs = validate_keys(keys)
    sinks = _batch_sinks(pairs, buffers)
    strict_, limit = client.strictness(strict), client.read_limit(max_tier)
    return ReadCall("batch_get_into", pairs, _into_each(sinks), strict_, limit, _size)


def batch_get_alloc(
    client: ClientState,
    /,
    keys: Sequence[str],
    alloc: Callable[[int], T],
    *,
    strict: bool | None = None,
    max_tier: str | None = None,
) -> Job[list[T | None]]:
    """Read each key into a buffer ``alloc(size)`` makes once the block's size is known
    (writable, at least ``size`` bytes): the buffers, None where a key missed. The bytes
    are copied once, into them; ``alloc`` runs in the calling thread (an ``AsyncClient``'s
    on its event loop)."""
    pairs = validate_keys(keys)
    made: dict[int, T] = {}

    def sink_for(index: int, key: str, size: int) -> tuple[memoryview | Parts | None, bool]:
        buffer = alloc(size)
        sink = as_sink(buffer)
        check_fits(sink, size, key)
        made[index] = buffer
        return sink[:size], True

    strict_, limit = client.strictness(strict), client.read_limit(max_tier)
    return ReadCall(
        "batch_get_alloc",
        pairs,
        sink_for,
        strict_,
        limit,
        lambda i, _item: made.get(i),
        direct=False,  # its buffers are made for a known size
    )


def exists(client: ClientState, /, key: str, *, strict: bool | None = None) -> Job[bool]:
    """Whether the index has ``key`` (the bytes are not checked; False on failure unless the
    client is strict)."""
    validate_key(key)
    return client.lookup_query(
        "exists", [key], lambda r: bool(r.entries[0].found), False, client.strictness(strict)
    )


def batch_exists(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[bool]]:
    """Whether the index has each key, in one call to a master that sends no entries
    (cheaper than :meth:`sizes` for a long batch); all False on failure unless strict."""
    names = validate_key_names(keys)
    if not names:
        return Answered([])
    strict_ = client.strictness(strict)
    neutral = [False] * len(names)

    def found(response: master_pb2.PrefixMatchResponse) -> list[bool] | Query[Any]:
        client.floor.raise_to(response.revision)
        if len(response.found) == len(names):
            return list(response.found)
        # A master of an older release answers the count only: ask a Lookup.
        return client.lookup_query(
            "exists", names, lambda r: [e.found for e in r.entries], neutral, strict_
        )

    request = master_pb2.PrefixMatchRequest(keys=names, min_revision=client.floor.value, each=True)
    return Query("exists", "PrefixMatch", request, found, neutral, strict_)


def sizes(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[int | None]]:
    """Each key's block size in bytes, or None where the index has no such key (one lookup;
    no bytes are read; None for all on failure unless strict)."""
    names = validate_key_names(keys)
    if not names:
        return Answered([])

    def sizes(response: master_pb2.LookupResponse) -> list[int | None]:
        return [int(e.size_bytes) if e.found else None for e in response.entries]

    neutral: list[int | None] = [None] * len(names)
    return client.lookup_query("sizes", names, sizes, neutral, client.strictness(strict))


def locate(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[BlockLocation | None]]:
    """Where the index has each key's block — its size, version, checksum, the fastest tier
    a replica reported and the live nodes holding it — or None where it has no such key
    (one lookup; no bytes are read; None for all on failure unless strict)."""
    names = validate_key_names(keys)
    if not names:
        return Answered([])

    def locations(response: master_pb2.LookupResponse) -> list[BlockLocation | None]:
        members = members_of(response)
        return [BlockLocation.from_entry(e, members) if e.found else None for e in response.entries]

    neutral: list[BlockLocation | None] = [None] * len(names)
    return client.lookup_query("locate", names, locations, neutral, client.strictness(strict))


def prefix_match(
    client: ClientState,
    /,
    keys: Sequence[str],
    *,
    strict: bool | None = None,
    fetch_entries: bool = True,
) -> Job[int]:
    """How many leading keys of a chain are cached (0 on failure), in one call to a master.
    ``fetch_entries`` (up to 1024 keys): the call brings the keys' index entries into the
    lookup cache, so that a get of the hits right after asks the index nothing; False asks
    for the count only, which is cheaper for this call and the master (a probe that reads
    may not follow, or a latency-bound hit query). Keys of kvpool's scheme (``kvpool.keys``)
    are read by content, asking the index nothing anyway: for them the count only is asked
    either way (``direct_reads="off"`` fetches)."""
    names = validate_key_names(keys)
    if not names:
        return Answered(0)
    strict_ = client.strictness(strict)
    if fetch_entries and len(names) <= PREFIX_LOOKUP_MAX_KEYS and not _by_content(client, names):
        return client.lookup_query("prefix_match", names, _leading_hits, 0, strict_)

    def matched(response: master_pb2.PrefixMatchResponse) -> int:
        client.floor.raise_to(response.revision)
        return min(int(response.matched), len(names))

    request = master_pb2.PrefixMatchRequest(keys=names, min_revision=client.floor.value)
    return Query("prefix_match", "PrefixMatch", request, matched, 0, strict_)


def pin(client: ClientState, /, keys: Sequence[str], replicas: int = 1) -> Job[list[bool]]:
    """Pin keys at ``replicas`` copies (0: unpin): never evicted, kept at that count by the
    masters, replicated in the index (survives a master failover). True per key pinned (or
    unpinned), False when the index has no such key. Raises PinQuotaExceededError above the
    masters' pin_quota (the keys that fit are pinned), and any other failure as its typed
    error: pinning is an explicit request, never a silent miss."""
    pairs = validate_keys(keys)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise InvalidArgumentError(f"replicas: expected an int >= 0, got {replicas!r}")
    client.strictness(True)  # refuses a closed client
    if not pairs:
        return Answered([])
    request = master_pb2.PinRequest(
        request_id=os.urandom(16), keys=[k for k, _ in pairs], replicas=replicas
    )

    def pinned(response: master_pb2.PinResponse) -> list[bool]:
        client.floor.raise_to(response.revision)
        statuses = list(response.statuses)
        if len(statuses) != len(pairs):
            raise InternalError(f"Pin answered {len(statuses)} statuses for {len(pairs)} keys")
        over = [k for (k, _), s in zip(pairs, statuses, strict=True) if s == PIN_QUOTA]
        if over:
            raise PinQuotaExceededError(
                f"pin quota exceeded: {len(over)} of {len(pairs)} keys not pinned (first: "
                f"{over[0]!r}); pinned {response.pinned_bytes} of {response.quota_bytes} "
                "bytes (raise the masters' pin_quota or pin fewer blocks)"
            )
        return [s == PIN_OK for s in statuses]

    return Query("pin", "Pin", request, pinned, [], True, leader_only=True)


def unpin(client: ClientState, /, keys: Sequence[str]) -> Job[list[bool]]:
    """End pins (True per key the index has)."""
    return pin(client, keys, 0)


def remove(client: ClientState, /, key: str, *, strict: bool | None = None) -> Job[bool]:
    """Remove ``key``; True if the index had it. Replicas are told to drop the bytes, best
    effort."""
    validate_key(key)
    return client.remove_query(
        "remove", [key], client.strictness(strict), False, lambda r: bool(r.removed[0])
    )


def batch_remove(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[bool]]:
    """Remove many keys with one commit; True per key the index had (False for all on
    failure unless strict)."""
    names = validate_key_names(keys)
    if not names:
        return Answered([])
    neutral = [False] * len(names)
    strict_ = client.strictness(strict)
    return client.remove_query("batch_remove", names, strict_, neutral, lambda r: list(r.removed))


def remove_prefix(client: ClientState, /, prefix: str, *, limit: int = 0) -> Job[tuple[int, bool]]:
    """Remove keys that start with ``prefix`` (``""``: every key in the cluster), at most
    ``limit`` (0: the masters' step, 4096) in one Raft commit: (keys removed, whether
    matching keys are left — call again). Replicas are told to drop the bytes, best effort.
    An admin call: failures raise, typed."""
    if not isinstance(prefix, str):
        raise InvalidArgumentError(f"a prefix must be a str, not {type(prefix).__name__}")
    client.strictness(True)  # refuses a closed client
    return client.remove_query(
        "remove_prefix",
        [],
        True,
        (0, False),
        lambda r: (int(r.prefix_removed), bool(r.more)),
        prefixes=(prefix,),
        limit=limit,
    )


def _fresh_bytes(_index: int, _key: str, _size: int) -> tuple[memoryview | Parts | None, bool]:
    """Into new bytes (get, batch_get)."""
    return None, False


def _batch_sinks(
    pairs: list[tuple[str, bytes]], buffers: Sequence[object]
) -> list[memoryview | Parts]:
    if isinstance(buffers, str | bytes) or not isinstance(buffers, Sequence):
        raise InvalidArgumentError("batch_get_into takes a sequence of buffers, one per key")
    if len(buffers) != len(pairs):
        raise InvalidArgumentError(
            f"batch_get_into: {len(pairs)} keys but {len(buffers)} buffers (one per key)"
        )
    return [as_into(b) for b in buffers]


def _into_each(sinks: list[memoryview | Parts]) -> SinkFactory:
    """Into each key's own buffer (batch_get_into; get_into's one): BufferTooSmallError when
    a block does not fit its buffer."""

    def caller(index: int, key: str, size: int) -> tuple[memoryview | Parts | None, bool]:
        sink = sinks[index]
        if size == DIRECT_SIZE:
            return sink, True
        check_fits(sink, size, key)
        return sink[:size], True

    return caller


def _result(_index: int, item: ReadItem) -> bytes:
    return item.result()


def _size(_index: int, item: ReadItem) -> int:
    return int(item.entry.size_bytes)


def _leading_hits(response: master_pb2.LookupResponse) -> int:
    """prefix_match from a Lookup: the leading run of found keys. The entries are in the lookup
    cache by then, so the get of the hits that an engine sends next needs no second index round
    trip."""
    entries = response.entries
    return next((i for i, e in enumerate(entries) if not e.found), len(entries))


def _by_content(client: ClientState, names: list[str]) -> bool:
    """Every key is one this client reads by content (``direct_reads``): a get of them asks
    the index nothing, so their entries are not worth fetching."""
    direct = client.direct_keys
    return direct is not None and all(map(direct, names))


def _first(receipts: list[PutReceipt | None]) -> PutReceipt | None:
    (first,) = receipts
    return first


def _first_committed(receipts: list[PutReceipt | None]) -> bool:
    return _first(receipts) is not None


def _each_committed(receipts: list[PutReceipt | None]) -> list[bool]:
    return [r is not None for r in receipts]


def _same(receipts: list[PutReceipt | None]) -> list[PutReceipt | None]:
    return receipts


F = TypeVar("F", bound=Callable[..., Any])


def described(operation: F, build: Callable[..., Any]) -> F:
    """``operation``, a driver's method carrying out ``build``'s jobs, named, documented and
    signed as ``build`` (but for what it answers: the driver's)."""
    operation.__name__ = build.__name__
    operation.__qualname__ = build.__qualname__
    operation.__doc__ = build.__doc__
    operation.__wrapped__ = build  # type: ignore[attr-defined]
    signature = inspect.signature(build)
    this, *rest = signature.parameters.values()
    self = this.replace(name="self", annotation=inspect.Parameter.empty)
    empty = inspect.Signature.empty
    operation.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self, *rest], return_annotation=empty
    )
    return operation
