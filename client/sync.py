"""The synchronous client an inference engine embeds: ``from kvpool import Client``.

    with Client(["10.0.0.1:7300", "10.0.0.2:7300", "10.0.0.3:7300"]) as kv:
        kv.put("model-x/tp0/blk/3f2a…", block)       # True once committed
        data = kv.get("model-x/tp0/blk/3f2a…")        # bytes, or None on a miss

Every call runs in the caller's thread through :class:`~kvpool.client.fastpath.SyncPath`, the
client's state (:mod:`kvpool.client.state`) driven with blocking I/O: no event loop and no
thread of the client's own (but the /metrics server's, when ``metrics_port`` asks for one). One
``Client`` may be shared by many engine threads. Misses and failures of the cache return None /
False (or raise the typed error with ``strict=True``); bad keys and values raise in every mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvpool.client.fastpath import SyncPath
from kvpool.client.plans import BlockLocation
from kvpool.client.settings import DEFAULTS, make_config
from kvpool.client.state import PutReceipt
from kvpool.client.values import BytesLike, WritableBuffer, as_payload

T = TypeVar("T")


def _shutdown(path: SyncPath) -> None:
    """Close the client's connections and its /metrics server. Runs once (weakref.finalize):
    from close(), or when the Client is garbage-collected, or at interpreter exit."""
    path.close()
    path.metrics.close_threaded()


class Client:
    """A kvpool client: put and get KV-cache blocks by key. Thread-safe."""

    def __init__(
        self,
        masters: list[str] | str,
        *,
        timeout_s: float = DEFAULTS.timeout_s,
        replicas: int = DEFAULTS.replicas,
        strict: bool = False,
        max_value_size: int = DEFAULTS.max_value_size,
        connections_per_node: int = DEFAULTS.connections_per_node,
        max_tier: str = DEFAULTS.max_tier,
        transport: str = DEFAULTS.transport,
        lookup_cache_size: int = DEFAULTS.lookup_cache_size,
        lookup_cache_ttl_s: float = DEFAULTS.lookup_cache_ttl_s,
        hedge_reads: bool = DEFAULTS.hedge_reads,
        hedge_delay_ms: float = DEFAULTS.hedge_delay_ms,
        metrics_port: int = DEFAULTS.metrics_port,
        metrics_host: str = DEFAULTS.metrics_host,
        cluster_token: str = DEFAULTS.cluster_token,
        cluster_token_file: str = DEFAULTS.cluster_token_file,
        tls_ca_file: str = DEFAULTS.tls_ca_file,
        tls_cert_file: str = DEFAULTS.tls_cert_file,
        tls_key_file: str = DEFAULTS.tls_key_file,
        tls_server_name: str = DEFAULTS.tls_server_name,
    ) -> None:
        """``transport``: ``auto`` (a node on this host through its shared memory, others
        over TCP), ``tcp`` or ``shm`` (shared memory only; a node it cannot reach that way
        is a failure) — to measure both on one host. ``lookup_cache_size``: index entries
        kept so that a repeated get skips the master (0: none). ``cluster_token`` (or
        ``cluster_token_file``): the cluster's token, when it has one; ``tls_ca_file``: dial the
        masters over TLS checked against this CA (``tls_cert_file``/``tls_key_file``: a client
        certificate). Unset, these default to the ``KVPOOL_CLUSTER_TOKEN``,
        ``KVPOOL_CLUSTER_TOKEN_FILE`` and ``KVPOOL_TLS_*`` environment variables.
        ``hedge_reads``: a read whose replica has not answered after ``hedge_delay_ms`` (plus
        1 ms per MB read) is also sent to the key's next replica; the first good answer wins.
        ``metrics_port``: serve this client's Prometheus /metrics on ``metrics_host``
        (127.0.0.1; 0: any free port, see :attr:`metrics_address`; -1: off). ``max_tier``
        (gpu, cpu, ssd): the slowest tier a get accepts when it does not say (empty: any).
        Every default is :class:`~kvpool.config.ClientConfig`'s."""
        config = make_config(
            masters,
            timeout_s=timeout_s,
            replicas=replicas,
            max_value_size=max_value_size,
            connections_per_node=connections_per_node,
            max_tier=max_tier,
            transport=transport,
            lookup_cache_size=lookup_cache_size,
            lookup_cache_ttl_s=lookup_cache_ttl_s,
            hedge_reads=hedge_reads,
            hedge_delay_ms=hedge_delay_ms,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            cluster_token=cluster_token,
            cluster_token_file=cluster_token_file,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_server_name=tls_server_name,
        )
        self._path = SyncPath(config, strict=strict)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._path)
        if config.metrics_port != -1:
            try:
                self._path.metrics.start_threaded(config.metrics_host, config.metrics_port)
            except BaseException:
                self.close()
                raise

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this client's /metrics ("" when off)."""
        return self._path.metrics.address

    # --- the API --------------------------------------------------------------------------

    def put(self, key: str, value: BytesLike, *, strict: bool | None = None) -> bool:
        """Store ``value`` under ``key``: True once committed; False on failure (strict raises).

        ``value``: bytes, bytearray, C-contiguous memoryview or numpy array (sent as its raw
        bytes). Do not modify it until put returns."""
        return self._path.put_receipt(key, value, strict=strict) is not None

    def put_receipt(
        self, key: str, value: BytesLike, *, strict: bool | None = None
    ) -> PutReceipt | None:
        """As :meth:`put`, answering the commit's receipt (version, write id, index revision,
        replica node ids) instead of True; None on failure (strict raises as put does)."""
        return self._path.put_receipt(key, value, strict=strict)

    def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        """The bytes stored under ``key``, or None on a miss or any failure (strict raises
        BlockMissError, ChecksumMismatchError, DeadlineExceededError, UnavailableError…).
        ``max_tier`` ("gpu", "cpu", "ssd"): a block held only on a slower tier is a miss."""
        data: bytes | None = self._path.get(key, strict=strict, max_tier=max_tier)
        return data

    def get_into(
        self,
        key: str,
        buffer: WritableBuffer,
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> int | None:
        """Read the block straight into ``buffer`` (writable, C-contiguous, large enough, else
        BufferTooSmallError / InvalidValueError): its size in bytes, or None (the buffer's
        content is then undefined). The bytes are copied once, into ``buffer``."""
        return self._path.get_into(key, buffer, strict=strict, max_tier=max_tier)

    def exists(self, key: str) -> bool:
        """Whether the index has ``key`` (False on failure unless the client is strict)."""
        return self._path.exists(key)

    def batch_exists(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Whether the index has each key, in one call to a master that sends no entries
        (cheaper than :meth:`sizes` for a long batch); all False on failure unless strict."""
        return self._path.batch_exists(keys, strict=strict)

    def sizes(self, keys: Sequence[str], *, strict: bool | None = None) -> list[int | None]:
        """Each key's block size in bytes, or None where the index has no such key (one lookup;
        no bytes are read; None for all on failure unless strict)."""
        return self._path.sizes(keys, strict=strict)

    def locate(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> list[BlockLocation | None]:
        """Where the index has each key's block — its size, version, checksum, the fastest tier
        a replica reported and the live nodes holding it — or None where it has no such key
        (one lookup; no bytes are read; None for all on failure unless strict)."""
        return self._path.locate(keys, strict=strict)

    def remove(self, key: str) -> bool:
        """Remove ``key``; True if the index had it."""
        return self._path.remove(key)

    def batch_put(
        self, items: Mapping[str, BytesLike] | Sequence[tuple[str, BytesLike]]
    ) -> list[bool]:
        """Store many blocks with one commit; one bool per item, in order."""
        return [r is not None for r in self._path.batch_put_receipts(items)]

    def batch_put_receipts(
        self,
        items: Mapping[str, BytesLike] | Sequence[tuple[str, BytesLike]],
        *,
        strict: bool | None = None,
    ) -> list[PutReceipt | None]:
        """As :meth:`batch_put`, with each committed item's receipt (None where it failed)."""
        return self._path.batch_put_receipts(items, strict=strict)

    def batch_get(self, keys: Sequence[str], *, max_tier: str | None = None) -> list[bytes | None]:
        """Each key's bytes or None, in order (one lookup for the keys not cached, one MGET
        per node)."""
        return self._path.batch_get(keys, max_tier=max_tier)

    def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[WritableBuffer],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[int | None]:
        """Read each key into its own buffer (``buffers[i]`` for ``keys[i]``): each block's size
        or None. The bytes are copied once, into the buffers."""
        return self._path.batch_get_into(keys, buffers, strict=strict, max_tier=max_tier)

    def batch_get_alloc(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], T],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[T | None]:
        """Read each key into a buffer ``alloc(size)`` makes once the block's size is known
        (writable, at least ``size`` bytes): the buffers, None where a key missed. The bytes
        are copied once, into them; ``alloc`` runs in the calling thread."""
        return self._path.batch_get_alloc(keys, alloc, strict=strict, max_tier=max_tier)

    def batch_remove(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Remove many keys with one commit; True per key the index had (False for all on
        failure unless strict)."""
        return self._path.batch_remove(keys, strict=strict)

    def remove_prefix(self, prefix: str, *, limit: int = 0) -> tuple[int, bool]:
        """Remove keys that start with ``prefix`` (``""``: every key in the cluster), at most
        ``limit`` (0: the masters' step, 4096) in one Raft commit: (keys removed, whether
        matching keys are left — call again). Replicas are told to drop the bytes, best effort.
        An admin call: failures raise, typed."""
        return self._path.remove_prefix(prefix, limit=limit)

    def pin(self, keys: Sequence[str], replicas: int = 1) -> list[bool]:
        """Pin keys at ``replicas`` copies: never evicted, kept at that count by the masters,
        replicated in the index (survives a master failover). True per key pinned, False when
        the index has no such key; raises PinQuotaExceededError above the masters' pin_quota,
        and other failures as typed errors."""
        return self._path.pin(keys, replicas)

    def unpin(self, keys: Sequence[str]) -> list[bool]:
        """End pins (True per key the index has)."""
        return self._path.pin(keys, 0)

    def prefix_match(self, keys: Sequence[str], *, fetch_entries: bool = True) -> int:
        """How many leading keys of a chain are cached (0 on failure), in one call to a
        master, from the calling thread. ``fetch_entries`` (up to 1024 keys): the call brings
        the keys' index entries into the lookup cache, so that a get of the hits right after
        asks the index nothing; False asks for the count only, which is cheaper for this call
        and the master (a probe that reads may not follow, or a latency-bound hit query)."""
        return self._path.prefix_match(keys, fetch_entries=fetch_entries)

    def get_or_compute(self, key: str, fn: Callable[[], BytesLike]) -> bytes:
        """The cached bytes; on a miss ``fn()``'s value, stored best effort (never raises
        because the store failed). ``fn`` runs in the calling thread; its exceptions
        propagate."""
        data = self.get(key, strict=False)
        if data is not None:
            return data
        value = fn()
        payload = as_payload(value, self._path.config.max_value_size)
        computed = value if type(value) is bytes else bytes(payload)
        return self._path.store_computed(key, computed)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses (total and by reason), puts ok/failed, fallbacks (values
        get_or_compute had to compute), replica retries, ring refreshes."""
        return self._path.stats

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close connections (and the /metrics server). Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<kvpool.Client masters={list(self._path.config.masters)} {state}>"
