"""Counters a client keeps about itself: hits, misses by reason, puts, fallbacks.

Updated by whichever thread carries a call out (the engine's threads for the synchronous
client, the event loop for the async one) and read from any: every update and snapshot holds a
lock (cheap next to a network round trip).
"""

from __future__ import annotations

import threading
from typing import Any

MISS_REASONS: tuple[str, ...] = (
    "absent",  # the index has no such key (or the node never held it)
    "evicted",  # the node evicted it
    "slow_tier",  # held only on a tier slower than the get's max_tier
    "node_down",  # no replica's node could be reached
    "version_mismatch",  # the node holds another write of the key, or not yet published
    "checksum_mismatch",  # bytes read did not match the checksum stored at put time
    "timeout",  # the call's deadline passed
    "unavailable",  # the masters could not answer
    "node_error",  # a node answered with an error status
)
"""Why a read was a miss. Misses of a key with several replicas count the strongest reason
seen (see :data:`REASON_PRIORITY`)."""

REASON_PRIORITY: tuple[str, ...] = (
    "checksum_mismatch",
    "version_mismatch",
    "evicted",
    "slow_tier",
    "absent",
    "node_error",
    "node_down",
    "timeout",
    "unavailable",
)


def strongest_reason(reasons: list[str]) -> str:
    """The reason to report for a key whose replicas each failed for one of ``reasons``."""
    for reason in REASON_PRIORITY:
        if reason in reasons:
            return reason
    return reasons[0] if reasons else "absent"


class ClientStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = dict.fromkeys(MISS_REASONS, 0)
        self._puts_ok = 0
        self._puts_failed = 0
        self._fallbacks = 0
        self._replica_retries = 0
        self._ring_refreshes = 0
        self._hedged = 0
        self._hedge_wins = 0
        self._direct_hits = 0
        self._direct_misses = 0
        self._node_holds = 0

    def node_held(self, _member_id: int) -> None:
        with self._lock:
            self._node_holds += 1

    def direct(self, hits: int, misses: int) -> None:
        with self._lock:
            self._direct_hits += hits
            self._direct_misses += misses

    def hit(self, n: int = 1) -> None:
        with self._lock:
            self._hits += n

    def miss(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._misses[reason] = self._misses.get(reason, 0) + n

    def puts(self, ok: int, failed: int) -> None:
        with self._lock:
            self._puts_ok += ok
            self._puts_failed += failed

    def fallback(self) -> None:
        with self._lock:
            self._fallbacks += 1

    def replica_retries(self, n: int) -> None:
        with self._lock:
            self._replica_retries += n

    def hedged(self, sent: int, won: int) -> None:
        with self._lock:
            self._hedged += sent
            self._hedge_wins += won

    def ring_refreshed(self) -> None:
        with self._lock:
            self._ring_refreshes += 1

    def snapshot(self) -> dict[str, Any]:
        """A copy: ``hits``, ``misses`` (total), ``misses_by_reason``, ``puts_ok``,
        ``puts_failed``, ``fallbacks`` (get_or_compute computed the value), ``replica_retries``
        (reads that moved on to another replica), ``ring_refreshes``, ``hedged_reads`` (keys
        also asked of a second replica because the first was slow), ``hedge_wins`` (keys the
        second replica served), ``direct_hits`` / ``direct_misses`` (keys read by content from
        their ring node with no Lookup first, and those that missed there and were looked
        up), ``node_holds`` (times a node that failed a request was held back: see
        ``node_retry_ms``)."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": sum(self._misses.values()),
                "misses_by_reason": dict(self._misses),
                "puts_ok": self._puts_ok,
                "puts_failed": self._puts_failed,
                "fallbacks": self._fallbacks,
                "replica_retries": self._replica_retries,
                "ring_refreshes": self._ring_refreshes,
                "hedged_reads": self._hedged,
                "hedge_wins": self._hedge_wins,
                "direct_hits": self._direct_hits,
                "direct_misses": self._direct_misses,
                "node_holds": self._node_holds,
            }
