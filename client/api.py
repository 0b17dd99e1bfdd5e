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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.client.commits import PutReceipt
from kvpool.client.plans import BlockLocation
from kvpool.client.state import ClientState, Job, PutCall, WarmUp, WarmUpCall, ask
from kvpool.client.values import Into, PutItems, Value

T = TypeVar("T")

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
    return client.get_call(key, strict, max_tier)


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
    return client.get_into_call(key, buffer, strict, max_tier)


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
    return client.batch_get_call(keys, strict, max_tier)


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
    return client.batch_get_into_call(keys, buffers, strict, max_tier)


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
    return client.batch_get_alloc_call(keys, alloc, strict, max_tier)


def exists(client: ClientState, /, key: str, *, strict: bool | None = None) -> Job[bool]:
    """Whether the index has ``key`` (the bytes are not checked; False on failure unless the
    client is strict)."""
    return client.exists_query(key, strict)


def batch_exists(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[bool]]:
    """Whether the index has each key, in one call to a master that sends no entries
    (cheaper than :meth:`sizes` for a long batch); all False on failure unless strict."""
    return ask(client.batch_exists_query(keys, strict))


def sizes(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[int | None]]:
    """Each key's block size in bytes, or None where the index has no such key (one lookup;
    no bytes are read; None for all on failure unless strict)."""
    return ask(client.sizes_query(keys, strict))


def locate(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[BlockLocation | None]]:
    """Where the index has each key's block — its size, version, checksum, the fastest tier
    a replica reported and the live nodes holding it — or None where it has no such key
    (one lookup; no bytes are read; None for all on failure unless strict)."""
    return ask(client.locate_query(keys, strict))


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
    return ask(client.prefix_match_query(keys, strict, fetch_entries))


def pin(client: ClientState, /, keys: Sequence[str], replicas: int = 1) -> Job[list[bool]]:
    """Pin keys at ``replicas`` copies (0: unpin): never evicted, kept at that count by the
    masters, replicated in the index (survives a master failover). True per key pinned (or
    unpinned), False when the index has no such key. Raises PinQuotaExceededError above the
    masters' pin_quota (the keys that fit are pinned), and any other failure as its typed
    error: pinning is an explicit request, never a silent miss."""
    return ask(client.pin_query(keys, replicas))


def unpin(client: ClientState, /, keys: Sequence[str]) -> Job[list[bool]]:
    """End pins (True per key the index has)."""
    return pin(client, keys, 0)


def remove(client: ClientState, /, key: str, *, strict: bool | None = None) -> Job[bool]:
    """Remove ``key``; True if the index had it. Replicas are told to drop the bytes, best
    effort."""
    return client.remove_one_query(key, strict)


def batch_remove(
    client: ClientState, /, keys: Sequence[str], *, strict: bool | None = None
) -> Job[list[bool]]:
    """Remove many keys with one commit; True per key the index had (False for all on
    failure unless strict)."""
    return ask(client.batch_remove_query(keys, strict))


def remove_prefix(client: ClientState, /, prefix: str, *, limit: int = 0) -> Job[tuple[int, bool]]:
    """Remove keys that start with ``prefix`` (``""``: every key in the cluster), at most
    ``limit`` (0: the masters' step, 4096) in one Raft commit: (keys removed, whether
    matching keys are left — call again). Replicas are told to drop the bytes, best effort.
    An admin call: failures raise, typed."""
    return ask(client.remove_prefix_query(prefix, limit))


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
