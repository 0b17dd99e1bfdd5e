"""Client operations written once, with no I/O: each says what it needs done and takes the
answers.

A read of many keys is :func:`read_flow`, a generator. It yields a request — :class:`Lookup`
(ask the index for these keys) or :class:`Read` (read these items from their replicas) — and is
sent the answer: the ``LookupResponse`` for a Lookup, nothing for a Read (the data plane has
filled the items in place). It returns one item per key. Two drivers run it: the synchronous
client's fast path (:mod:`kvpool.client.fastpath`) with blocking calls in the caller's thread,
and :class:`~kvpool.client.core.ClientCore` on the event loop, awaiting them. Everything the
read decides is here, once:

* keys the lookup cache holds are read through their cached entries, the others are looked up
  first, in one Lookup;
* a key the index lacks is None, and is not read;
* an item read through a cached entry that missed may be stale: while time is left before the
  deadline, those keys leave the cache and are looked up once more and read once more;
* the cached entry of an item that still failed is dropped (only if it names the write id
  that failed).

The clock is passed in (the driver's: ``time.monotonic`` or the event loop's ``time``), so a
test drives a read step by step with no socket, no thread and no event loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

from kvpool.client.cache import LookupCache
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.plans import ReadItem
from kvpool.errors import BlockMissError
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import TierLevel

__all__ = ["Lookup", "Read", "ReadFlow", "SinkFactory", "read_flow", "read_items"]

SinkFactory = Callable[[int, str, int], tuple[memoryview | None, bool]]
"""Where the bytes of the i-th key go (None: into fresh bytes), given its index, key and size,
and whether that is the caller's buffer."""


@dataclass(slots=True)
class Lookup:
    """Ask the index for the entries of ``keys``; answer with the ``LookupResponse``."""

    keys: list[str]


@dataclass(slots=True)
class Read:
    """Read ``items`` from their replicas until read, out of replicas or out of time; ``live``
    names the members the last Lookup answered with (before the cached ones). Answer with
    nothing: the items carry the outcome. (Not frozen, as Lookup: one is built for every get,
    and a frozen dataclass takes twice as long to build.)"""

    items: list[ReadItem]
    live: dict[int, MemberInfo]


ReadStep = Lookup | Read
ReadFlow = Generator[ReadStep, master_pb2.LookupResponse | None, list[ReadItem | None]]


def read_flow(
    cache: LookupCache,
    placement: Placement,
    pairs: list[tuple[str, bytes]],
    sink_for: SinkFactory,
    *,
    limit: int,
    deadline: float,
    clock: Callable[[], float],
) -> ReadFlow:
    """Read ``pairs`` (key, key bytes): one ReadItem per key the index holds, None for the
    others (see the module doc)."""
    entries: list[common_pb2.BlockEntry | None] = [cache.get(k) for k, _ in pairs]
    from_cache = [e is not None for e in entries]
    live: dict[int, MemberInfo] = {}
    todo = [i for i, e in enumerate(entries) if e is None]
    if todo:
        response = yield Lookup([pairs[i][0] for i in todo])
        assert response is not None
        live = members_of(response)
        for i, entry in zip(todo, response.entries, strict=True):
            entries[i] = entry
    items = read_items(placement, pairs, entries, from_cache, sink_for, limit=limit, now_s=clock())
    readable = [it for it in items if it is not None and it.replicas]
    if readable:
        yield Read(readable, live)
    stale = [i for i, it in enumerate(items) if it is not None and not it.ok and it.from_cache]
    if stale and clock() < deadline:
        # A cached entry missed: it may be stale. Look those keys up again, once.
        for i in stale:
            cache.drop(pairs[i][0])
        sub = [pairs[i] for i in stale]
        response = yield Lookup([k for k, _ in sub])
        assert response is not None
        fresh = read_items(
            placement,
            sub,
            list(response.entries),
            [False] * len(sub),
            sink_for,
            limit=limit,
            now_s=clock(),
            indexes=stale,
        )
        for i, item in zip(stale, fresh, strict=True):
            items[i] = item
        readable = [it for it in fresh if it is not None and it.replicas]
        if readable:
            yield Read(readable, members_of(response))
    for it in items:
        if it is not None and not it.ok:
            cache.drop(it.key, it.entry.write_id)
    return items


def members_of(response: master_pb2.LookupResponse) -> dict[int, MemberInfo]:
    """The members a Lookup answered with, by member id."""
    return {m.member_id: MemberInfo.from_proto(m) for m in response.members}


def read_items(
    placement: Placement,
    pairs: list[tuple[str, bytes]],
    entries: Sequence[common_pb2.BlockEntry | None],
    from_cache: Sequence[bool],
    sink_for: SinkFactory,
    *,
    limit: int,
    now_s: float,
    indexes: Sequence[int] | None = None,
) -> list[ReadItem | None]:
    """One ReadItem per found entry (None for keys the index lacks), its replicas in the order
    to try them; a block held only on a tier slower than ``limit`` is a ``slow_tier`` miss
    with no replica left to read. ``indexes``: the keys' places in the caller's batch."""
    items: list[ReadItem | None] = []
    append = items.append
    read_order = placement.read_order
    randrange = random.randrange
    slowest = TierLevel.SSD
    for n_item, ((key, key_bytes), entry, cached) in enumerate(
        zip(pairs, entries, from_cache, strict=True)
    ):
        if entry is None or not entry.found:
            append(None)
            continue
        index = indexes[n_item] if indexes is not None else n_item
        sink, caller_buffer = sink_for(index, key, entry.size_bytes)
        held = entry.replicas
        n = len(held)
        replicas = [held[0]] if n == 1 else read_order(held, now_s, randrange(max(1, n)))
        item = ReadItem(
            key,
            key_bytes,
            entry,
            sink=sink,
            caller_buffer=caller_buffer,
            replicas=replicas,
            max_tier=limit,
            from_cache=cached,
        )
        if limit and limit < entry.tier <= slowest:  # the index: on a slower tier
            item.replicas = []
            item.fail(
                "slow_tier",
                BlockMissError(
                    f"{key!r} is on the {TierLevel(entry.tier).name.lower()} tier, slower "
                    f"than max_tier {TierLevel(limit).name.lower()}",
                    reason="slow_tier",
                ),
            )
        append(item)
    return items
