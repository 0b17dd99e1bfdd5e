"""How an inference engine calls a store, per system, for the ``engine`` mode of
``kvpool-bench peers``: first ask which keys of a batch are present, then read the hits into
the caller's buffers — as SGLang's HiCache (``batch_exists`` then ``batch_get``) and LMCache
(``contains`` then ``get``) do.

* kvpool, ``prefix_match``: ``Client.prefix_match(keys)`` — for the bench's keys, which are of
  kvpool's scheme and read by content, one PrefixMatch (a count; for other keys one Lookup,
  whose entries the client caches so that the read that follows asks the index nothing) —
  then ``batch_get_into`` of the leading hits, by content;
* kvpool, ``batch_exists``: ``Client.batch_exists(keys)`` (per-key presence, no entries sent),
  then ``batch_get_into`` of every hit (by content: no Lookup);
* Mooncake Store: ``batch_is_exist(keys)``, then ``batch_get_into(hits, ptrs, sizes)``;
* Redis: pipelined ``EXISTS`` (one round trip), then pipelined ``GET`` of the hits.

The reads are the driver's own batched get (:meth:`SyncDriver.get_many`), the very call the
batch mode measures. For kvpool the calls the client makes to the masters are counted by
wrapping its master stub (:class:`MasterCallCounter`); a client without one counts nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from kvpool_bench.drivers import (
    Array,
    KvpoolDriver,
    MooncakeDriver,
    PassResult,
    RedisDriver,
    Result,
)


class EngineFlow(Protocol):
    label: str
    """The calls, as the report names them: "prefix_match + batch_get_into"."""

    def query(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are present (a prefix query answers True for its leading hits)."""
        ...

    def read(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        """Read ``keys`` (the hits) into ``dsts``."""
        ...

    def index_calls(self) -> dict[str, int] | None:
        """The calls made to the index so far, by method (None: not counted)."""
        ...


class MasterCallCounter:
    """Stands in for a kvpool client's master stub and counts its calls by method."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        self.calls[method] += 1
        return self._inner.call(method, request, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def count_master_calls(client: Any) -> MasterCallCounter | None:
    """Wrap the sync client's master stub (``client._masters``, private: feature-
    detected), so that its index calls can be counted; None where there is none."""
    masters = getattr(client, "_masters", None)
    if masters is None or not callable(getattr(masters, "call", None)):
        return None
    if isinstance(masters, MasterCallCounter):
        return masters
    counter = MasterCallCounter(masters)
    client._masters = counter
    return counter


class KvpoolFlow:
    def __init__(self, driver: KvpoolDriver, query: str) -> None:
        self._driver = driver
        self._client = driver.client
        self._query = query
        self.label = f"{query} + {driver.api['batch_get']}"
        self._counter = count_master_calls(self._client)

    def query(self, keys: Sequence[str]) -> list[bool]:
        if self._query == "prefix_match":
            hits = int(self._client.prefix_match(list(keys)))
            return [i < hits for i in range(len(keys))]
        return [bool(x) for x in self._client.batch_exists(list(keys))]

    def read(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        return self._driver.get_many(keys, dsts, res)

    def index_calls(self) -> dict[str, int] | None:
        return dict(self._counter.calls) if self._counter is not None else None


class _PeerFlow:
    """A peer's flow: its own query, then the driver's batched get; no index calls counted."""

    label = "?"

    def __init__(self, driver: MooncakeDriver | RedisDriver) -> None:
        self._driver = driver
        self._client = driver.client

    def read(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        return self._driver.get_many(keys, dsts, res)

    def index_calls(self) -> dict[str, int] | None:
        return None


class MooncakeFlow(_PeerFlow):
    label = "batch_is_exist + batch_get_into"

    def query(self, keys: Sequence[str]) -> list[bool]:
        return [int(x) == 1 for x in self._client.batch_is_exist(list(keys))]


class RedisFlow(_PeerFlow):
    label = "pipelined EXISTS + pipelined GET"

    def query(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [int(x) == 1 for x in pipe.execute()]


KVPOOL_QUERIES = ("prefix_match", "batch_exists")


def engine_flows(driver: object) -> dict[str, EngineFlow]:
    """The flows a system's driver runs in the engine mode, by query name; none for a driver
    without them (kvpool's AsyncClient driver: the mode drives the sync Client)."""
    if isinstance(driver, KvpoolDriver):
        return {q: KvpoolFlow(driver, q) for q in KVPOOL_QUERIES if hasattr(driver.client, q)}
    if isinstance(driver, MooncakeDriver):
        return {"batch_is_exist": MooncakeFlow(driver)}
    if isinstance(driver, RedisDriver):
        return {"exists": RedisFlow(driver)}
    return {}


def engine_queries(kind: str, api: str = "sync") -> tuple[str, ...]:
    """The flows the engine mode runs for a system of ``kind`` (none for kvpool's async
    client: the engine mode measures the sync Client, as SGLang and LMCache call it)."""
    if kind == "kvpool":
        return KVPOOL_QUERIES if api == "sync" else ()
    return {"mooncake": ("batch_is_exist",), "redis": ("exists",)}.get(kind, ())
