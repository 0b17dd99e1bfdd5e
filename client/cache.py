"""The client's cache of index entries: a get whose key is cached skips the Lookup call.

Safe because a read names the exact write id and the node serves exactly that write or a miss,
and the client checks the checksum: a stale entry can only cause a miss. A miss read through a
cached entry drops it and the get looks the key up again (so a stale entry costs one extra
round trip, never a wrong answer or a needless miss).

Monotonic per key: an entry replaces a cached one only with a version at least as high (a
lookup answered before a newer put of this client cannot bring the older write back); what
this client commits is cached as the index answered the commit, so it reads back its own
writes without a Lookup; a remove leaves a tombstone at its revision so that a lookup answered
before the remove cannot resurrect the key. Entries live ``ttl_s`` at
most, which bounds how long a write by another client on another node can go unseen.

Pure bookkeeping under a lock (a synchronous client's engine threads share it); the clock is
injected.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from kvpool.client.placement import MemberInfo
from kvpool.proto.v1 import common_pb2

TOMBSTONES = 4096
"""Removed keys remembered (with the revision of their removal)."""


class Cached(NamedTuple):  # a named tuple: a Lookup answer stores one per key
    entry: common_pb2.BlockEntry
    """As the index answered it (``found`` is True)."""
    revision: int
    """The index revision the answer was given at."""
    stored_at: float


class LookupCache:
    """``key → index entry`` for up to ``capacity`` keys, each for at most ``ttl_s``; the
    members the entries name, by member id."""

    def __init__(
        self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Cached] = {}
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self._members: dict[int, MemberInfo] = {}
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    # --- reads ------------------------------------------------------------------------------

    def get(self, key: str) -> common_pb2.BlockEntry | None:
        """The cached entry for ``key``, or None (absent or expired)."""
        if not self.capacity:
            return None
        cached = self._entries.get(key)
        if cached is None or self._clock() - cached.stored_at > self.ttl_s:
            self.misses += 1
            return None
        self.hits += 1
        return cached.entry

    def member(self, member_id: int) -> MemberInfo | None:
        return self._members.get(member_id)

    # --- updates ------------------------------------------------------------------------------

    def learn_members(self, members: list[MemberInfo]) -> None:
        if not self.capacity or not members:
            return
        with self._lock:
            for m in members:
                self._members[m.member_id] = m

    def store(self, key: str, entry: common_pb2.BlockEntry, revision: int) -> None:
        """Cache a found entry answered at ``revision`` unless the cache holds a newer write of
        the key or the key was removed after ``revision``."""
        self.store_many([key], [entry], revision)

    def store_many(
        self, keys: list[str], entries: list[common_pb2.BlockEntry], revision: int
    ) -> None:
        """:meth:`store` for a whole Lookup answer: one lock, one clock reading."""
        if not self.capacity:
            return
        now = self._clock()
        table, tombstones = self._entries, self._tombstones
        with self._lock:
            for key, entry in zip(keys, entries, strict=True):
                if not entry.found:
                    continue
                if tombstones:
                    removed_at = tombstones.get(key)
                    if removed_at is not None:
                        if revision <= removed_at:
                            continue
                        del tombstones[key]
                current = table.get(key)
                if current is not None:
                    if current.entry.version > entry.version:
                        continue
                elif len(table) >= self.capacity:
                    self._evict()
                table[key] = Cached(entry, revision, now)

    def committed(self, key: str, entry: common_pb2.BlockEntry, revision: int) -> None:
        """This client committed ``entry`` (the index answered at ``revision``): its next
        read of ``key`` needs no Lookup. (An engine reads back what it wrote — a later turn of
        the same chat, a prefetch of pages it backed up — more often than anything else; one
        that never does only cycles entries through the cache, at its capacity and TTL.)"""
        self.store(key, entry, revision)

    def drop(self, key: str, write_id: int = 0) -> None:
        """Forget ``key`` (only if it still names ``write_id``, when given): a read of it
        missed."""
        if not self.capacity:
            return
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None and (not write_id or cached.entry.write_id == write_id):
                del self._entries[key]

    def removed(self, key: str, revision: int) -> None:
        """The key was removed at ``revision``: forget it, and refuse older answers for it."""
        if not self.capacity:
            return
        with self._lock:
            self._entries.pop(key, None)
            self._tombstones[key] = max(revision, self._tombstones.get(key, 0))
            self._tombstones.move_to_end(key)
            while len(self._tombstones) > TOMBSTONES:
                self._tombstones.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _evict(self) -> None:
        """Drop the oldest eighth (insertion order): cheaper than exact LRU per hit."""
        n = max(1, len(self._entries) // 8)
        for key in list(self._entries)[:n]:
            del self._entries[key]
