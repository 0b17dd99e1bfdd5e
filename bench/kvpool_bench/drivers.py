"""One driver per measured system, all with the same shape, so that ``kvpool-bench peers`` runs
the very same passes against kvpool, Redis and Mooncake Store.

A *pass* is one timed loop over a list of keys: single-key (one call per key, each call
timed) or batched (``batch`` keys per call, each call timed). Puts read their values from the
worker's source arena; gets land in its destination arena where the API allows (kvpool's
``get_into``, Mooncake's ``get_into`` with registered buffers) or come back as ``bytes``
(Redis ``GET``, kvpool's ``batch_get``). Nothing is compared inside a pass: the worker checks
every byte afterwards, outside the timed loop.

Each driver says which calls it uses (:attr:`Driver.api`), and the kvpool driver picks up what
the client offers when it offers it — ``Client(transport=...)``, ``batch_get_into``,
``batch_remove``, ``AsyncClient`` — so the bench measures the fastest public path there is.
Peer packages are imported with :func:`importlib.import_module`: they are optional (the
``peers`` extra) and untyped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

Array = np.ndarray[Any, np.dtype[np.uint8]]
Result = Array | bytes | None
"""What a get produced for one key: the bytes read (a view of the destination, or a new
``bytes``), or None on a miss or an error."""

MAX_ERRORS = 5
REMOVE_THREADS = 32
"""Concurrent removes when the kvpool client has no batch remove (they share Raft commits)."""


@dataclass
class PassResult:
    """One timed pass: its wall-clock span, every call's duration, and per key what happened."""

    start: float = 0.0
    end: float = 0.0
    durations_s: list[float] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)  # puts: committed / stored
    got: list[Result] = field(default_factory=list)  # gets
    errors: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        if len(self.errors) < MAX_ERRORS and text not in self.errors:
            self.errors.append(text)


class Driver(Protocol):
    name: str
    api: dict[str, str]

    def put_pass(self, keys: Sequence[str], srcs: Sequence[Array], batch: int) -> PassResult: ...

    def get_pass(self, keys: Sequence[str], dsts: Sequence[Array], batch: int) -> PassResult: ...

    def remove(self, keys: Sequence[str]) -> None: ...

    def close(self) -> None: ...


def _chunks(n: int, batch: int) -> list[slice]:
    return [slice(i, min(n, i + batch)) for i in range(0, n, batch)]


class SyncDriver:
    """Passes built from four blocking calls; subclasses implement those."""

    name = "?"
    api: dict[str, str]

    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        raise NotImplementedError

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        raise NotImplementedError

    def put_many(self, keys: Sequence[str], srcs: Sequence[Array], res: PassResult) -> list[bool]:
        raise NotImplementedError

    def get_many(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        raise NotImplementedError

    def put_pass(self, keys: Sequence[str], srcs: Sequence[Array], batch: int) -> PassResult:
        res = PassResult()
        clock = time.perf_counter
        res.start = clock()
        if batch <= 0:
            for key, src in zip(keys, srcs, strict=True):
                t = clock()
                ok = self.put_one(key, src, res)
                res.durations_s.append(clock() - t)
                res.ok.append(ok)
        else:
            for part in _chunks(len(keys), batch):
                t = clock()
                oks = self.put_many(keys[part], srcs[part], res)
                res.durations_s.append(clock() - t)
                res.ok.extend(oks)
        res.end = clock()
        return res

    def get_pass(self, keys: Sequence[str], dsts: Sequence[Array], batch: int) -> PassResult:
        res = PassResult()
        clock = time.perf_counter
        res.start = clock()
        if batch <= 0:
            for key, dst in zip(keys, dsts, strict=True):
                t = clock()
                got = self.get_one(key, dst, res)
                res.durations_s.append(clock() - t)
                res.got.append(got)
        else:
            for part in _chunks(len(keys), batch):
                t = clock()
                gots = self.get_many(keys[part], dsts[part], res)
                res.durations_s.append(clock() - t)
                res.got.extend(gots)
        res.end = clock()
        return res


# --- kvpool ----------------------------------------------------------------------------------


def kvpool_features() -> dict[str, Any]:
    """What this kvpool client offers (feature detection, nothing is started)."""
    import kvpool
    from kvpool.client.sync import Client

    params = inspect.signature(Client.__init__).parameters
    async_client = getattr(kvpool, "AsyncClient", None)
    return {
        "version": kvpool.__version__,
        "transport_arg": "transport" in params,
        "batch_get_into": hasattr(Client, "batch_get_into"),
        "batch_remove": hasattr(Client, "batch_remove"),
        "async_client": async_client is not None,
    }


def _client_kwargs(cls: Any, timeout_s: float, transport: str | None) -> dict[str, Any]:
    """Constructor arguments; ``transport`` only where the client takes it (else an error:
    a transport asked for and silently not used would mislabel the numbers)."""
    kwargs: dict[str, Any] = {"timeout_s": timeout_s}
    if transport is None:
        return kwargs
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the constructor decide
        params = None
    if params is not None and not any(
        p.name == "transport" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
    ):
        raise RuntimeError(f"this kvpool client takes no transport= (asked for {transport!r})")
    kwargs["transport"] = transport
    return kwargs


def _into_results(
    sizes: Sequence[int | None], dsts: Sequence[Array], res: PassResult, call: str
) -> list[Result]:
    out: list[Result] = []
    for n, dst in zip(sizes, dsts, strict=True):
        if n is None:
            res.error(f"{call}: miss")
            out.append(None)
        else:
            out.append(dst[:n])
    return out


def _bytes_results(values: Sequence[bytes | None], res: PassResult, call: str) -> list[Result]:
    if any(v is None for v in values):
        res.error(f"{call}: miss")
    return list(values)


class KvpoolDriver(SyncDriver):
    """``kvpool.Client``: put / get_into one key, batch_put / batch_get(_into) many."""

    def __init__(self, client: Any, *, name: str = "kvpool", label: str = "kvpool.Client") -> None:
        self.name = name
        self._client = client
        # Newer clients only (feature-detected): called through Any, typed by their own branch.
        self._batch_get_into: Any = getattr(self._client, "batch_get_into", None)
        self._batch_remove: Any = getattr(self._client, "batch_remove", None)
        self._has_batch_into = self._batch_get_into is not None
        self.api = {
            "client": label,
            "put": "put",
            "get": "get_into",
            "batch_put": "batch_put",
            "batch_get": "batch_get_into" if self._has_batch_into else "batch_get",
        }

    @property
    def client(self) -> Any:
        """The kvpool.Client driven (the engine mode calls its queries)."""
        return self._client

    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        ok = bool(self._client.put(key, src))
        if not ok:
            res.error("put: not committed")
        return ok

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        n = self._client.get_into(key, dst)
        return _into_results([n], [dst], res, "get_into")[0]

    def put_many(self, keys: Sequence[str], srcs: Sequence[Array], res: PassResult) -> list[bool]:
        oks = [bool(ok) for ok in self._client.batch_put(list(zip(keys, srcs, strict=True)))]
        if not all(oks):
            res.error("batch_put: not committed")
        return oks

    def get_many(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        if self._has_batch_into:
            sizes = self._batch_get_into(list(keys), list(dsts))
            return _into_results(sizes, dsts, res, "batch_get_into")
        return _bytes_results(self._client.batch_get(list(keys)), res, "batch_get")

    def remove(self, keys: Sequence[str]) -> None:
        if self._batch_remove is not None:
            self._batch_remove(list(keys))
            return
        with ThreadPoolExecutor(REMOVE_THREADS) as pool:
            list(pool.map(self._client.remove, keys))

    def close(self) -> None:
        self._client.close()


class KvpoolAsyncDriver:
    """``kvpool.AsyncClient`` (or any object with the same coroutine methods), driven by a
    private event loop; each whole pass is one coroutine, so no call crosses a thread."""

    def __init__(
        self,
        make: Callable[[], Any],
        *,
        name: str,
        client_label: str,
    ) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()

        async def start() -> Any:
            client = make()
            if hasattr(client, "__aenter__"):
                client = await client.__aenter__() or client
            if hasattr(client, "warm_up"):  # as the engine backends do at start-up
                await client.warm_up()
            return client

        self._client = self._loop.run_until_complete(start())
        self._has_batch_into = hasattr(self._client, "batch_get_into")
        self._has_batch_remove = hasattr(self._client, "batch_remove")
        self.api = {
            "client": client_label,
            "put": "await put",
            "get": "await get_into",
            "batch_put": "await batch_put",
            "batch_get": "await batch_get_into" if self._has_batch_into else "await batch_get",
        }

    def _run(self, coro: Awaitable[PassResult]) -> PassResult:
        async def wrap() -> PassResult:
            return await coro

        return self._loop.run_until_complete(wrap())

    def put_pass(self, keys: Sequence[str], srcs: Sequence[Array], batch: int) -> PassResult:
        c = self._client

        async def run() -> PassResult:
            res = PassResult()
            clock = time.perf_counter
            res.start = clock()
            if batch <= 0:
                for key, src in zip(keys, srcs, strict=True):
                    t = clock()
                    ok = bool(await c.put(key, src))
                    res.durations_s.append(clock() - t)
                    res.ok.append(ok)
            else:
                for part in _chunks(len(keys), batch):
                    t = clock()
                    oks = await c.batch_put(list(zip(keys[part], srcs[part], strict=True)))
                    res.durations_s.append(clock() - t)
                    res.ok.extend(bool(ok) for ok in oks)
            res.end = clock()
            if not all(res.ok):
                res.error("put: not committed")
            return res

        return self._run(run())

    def get_pass(self, keys: Sequence[str], dsts: Sequence[Array], batch: int) -> PassResult:
        c = self._client

        async def run() -> PassResult:
            res = PassResult()
            clock = time.perf_counter
            res.start = clock()
            if batch <= 0:
                for key, dst in zip(keys, dsts, strict=True):
                    t = clock()
                    n = await c.get_into(key, dst)
                    res.durations_s.append(clock() - t)
                    res.got.extend(_into_results([n], [dst], res, "get_into"))
            else:
                for part in _chunks(len(keys), batch):
                    t = clock()
                    if self._has_batch_into:
                        sizes = await c.batch_get_into(list(keys[part]), list(dsts[part]))
                        got = _into_results(sizes, dsts[part], res, "batch_get_into")
                    else:
                        got = _bytes_results(await c.batch_get(list(keys[part])), res, "batch_get")
                    res.durations_s.append(clock() - t)
                    res.got.extend(got)
            res.end = clock()
            return res

        return self._run(run())

    def remove(self, keys: Sequence[str]) -> None:
        c = self._client

        async def run() -> None:
            if self._has_batch_remove:
                await c.batch_remove(list(keys))
                return
            sem = asyncio.Semaphore(REMOVE_THREADS)

            async def one(key: str) -> None:
                async with sem:
                    await c.remove(key)

            await asyncio.gather(*(one(k) for k in keys))

        self._loop.run_until_complete(run())

    def close(self) -> None:
        c = self._client

        async def run() -> None:
            if hasattr(c, "__aexit__"):
                await c.__aexit__(None, None, None)
                return
            closing = c.close()
            if inspect.isawaitable(closing):
                await closing

        try:
            self._loop.run_until_complete(run())
        finally:
            self._loop.close()


def make_kvpool_driver(
    masters: Sequence[str],
    *,
    transport: str | None,
    timeout_s: float,
    api: str,
    busy_poll_us: int = 0,
) -> Driver:
    """The kvpool driver: ``api`` "sync" drives ``kvpool.Client``, "async" drives
    ``kvpool.AsyncClient`` (an error where this kvpool has none); ``busy_poll_us``: the
    ``Client`` setting (measured as ``kvpool-...-busy-poll``)."""
    import kvpool

    name = "kvpool" if transport is None else f"kvpool-{transport}"
    settings = [f"transport={transport!r}"] if transport else []
    suffix = f"({', '.join(settings)})" if settings else ""
    if api == "async":
        async_cls = getattr(kvpool, "AsyncClient", None)
        if async_cls is None:
            raise RuntimeError("this kvpool has no AsyncClient")
        kwargs = _client_kwargs(async_cls, timeout_s, transport)
        return KvpoolAsyncDriver(
            lambda: async_cls(list(masters), **kwargs),
            name=f"{name}-async",
            client_label="kvpool.AsyncClient" + suffix,
        )
    from kvpool.client.sync import Client

    kwargs = _client_kwargs(Client, timeout_s, transport)
    if busy_poll_us:
        kwargs["busy_poll_us"] = busy_poll_us  # a client without it refuses: never mislabeled
        name += "-busy-poll"
        suffix = f"({', '.join([*settings, f'busy_poll_us={busy_poll_us}'])})"
    client = Client(list(masters), **kwargs)
    if hasattr(client, "warm_up"):  # as the engine backends do at start-up
        client.warm_up()
    return KvpoolDriver(client, name=name, label="kvpool.Client" + suffix)


# --- Redis -----------------------------------------------------------------------------------


class RedisDriver(SyncDriver):
    """redis-py (hiredis parser when installed): SET/GET, pipelined for batches."""

    name = "redis"

    def __init__(self, host: str, port: int, *, timeout_s: float) -> None:
        redis: Any = importlib.import_module("redis")
        self._r = redis.Redis(host=host, port=port, socket_timeout=timeout_s)
        self._r.ping()
        hiredis = bool(getattr(importlib.import_module("redis.utils"), "HIREDIS_AVAILABLE", 0))
        self.api = {
            "client": f"redis-py {redis.__version__}" + (" + hiredis" if hiredis else ""),
            "put": "SET",
            "get": "GET",
            "batch_put": "pipelined SET",
            "batch_get": "pipelined GET",
        }

    @property
    def client(self) -> Any:
        """The redis.Redis connection (the engine mode pipelines EXISTS on it)."""
        return self._r

    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        ok = bool(self._r.set(key, src.data))
        if not ok:
            res.error("SET: not OK")
        return ok

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        value: bytes | None = self._r.get(key)
        return _bytes_results([value], res, "GET")[0]

    def put_many(self, keys: Sequence[str], srcs: Sequence[Array], res: PassResult) -> list[bool]:
        pipe = self._r.pipeline(transaction=False)
        for key, src in zip(keys, srcs, strict=True):
            pipe.set(key, src.data)
        oks = [bool(x) for x in pipe.execute()]
        if not all(oks):
            res.error("pipelined SET: not OK")
        return oks

    def get_many(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return _bytes_results(pipe.execute(), res, "pipelined GET")

    def remove(self, keys: Sequence[str]) -> None:
        for part in _chunks(len(keys), 1000):
            self._r.delete(*keys[part])

    def close(self) -> None:
        self._r.close()


# --- Mooncake Store --------------------------------------------------------------------------


def _ptr(arr: Array) -> int:
    return int(arr.ctypes.data)


class MooncakeDriver(SyncDriver):
    """Mooncake Store's Python client over its TCP transport, contributing no segment of its
    own: put_from / get_into on registered buffers, batch_put_from / batch_get_into."""

    name = "mooncake"

    def __init__(
        self, master: str, arenas: Sequence[Array], *, local_buffer_bytes: int = 16 << 20
    ) -> None:
        store_mod: Any = importlib.import_module("mooncake.store")
        self._store = store_mod.MooncakeDistributedStore()
        rc = self._store.setup(
            "127.0.0.1", "P2PHANDSHAKE", 0, local_buffer_bytes, "tcp", "", master
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self._registered: list[int] = []
        for arena in arenas:
            rc = self._store.register_buffer(_ptr(arena), arena.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
            self._registered.append(_ptr(arena))
        self.api = {
            "client": "mooncake.store.MooncakeDistributedStore (tcp, P2PHANDSHAKE, no segment)",
            "put": "put_from",
            "get": "get_into",
            "batch_put": "batch_put_from",
            "batch_get": "batch_get_into",
        }

    @property
    def client(self) -> Any:
        """The MooncakeDistributedStore (the engine mode calls its batch_is_exist)."""
        return self._store

    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        rc = self._store.put_from(key, _ptr(src), src.nbytes)
        if rc != 0:
            res.error(f"put_from: {rc}")
        return bool(rc == 0)

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        n = int(self._store.get_into(key, _ptr(dst), dst.nbytes))
        if n < 0:
            res.error(f"get_into: {n}")
            return None
        return dst[:n]

    def put_many(self, keys: Sequence[str], srcs: Sequence[Array], res: PassResult) -> list[bool]:
        rcs = self._store.batch_put_from(
            list(keys), [_ptr(s) for s in srcs], [s.nbytes for s in srcs]
        )
        for rc in rcs:
            if rc != 0:
                res.error(f"batch_put_from: {rc}")
        return [rc == 0 for rc in rcs]

    def get_many(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        ns = self._store.batch_get_into(
            list(keys), [_ptr(d) for d in dsts], [d.nbytes for d in dsts]
        )
        out: list[Result] = []
        for n, dst in zip(ns, dsts, strict=True):
            if n < 0:
                res.error(f"batch_get_into: {n}")
                out.append(None)
            else:
                out.append(dst[:n])
        return out

    def remove(self, keys: Sequence[str]) -> None:
        for part in _chunks(len(keys), 1024):
            self._store.batch_remove(list(keys[part]), True)  # force: past the read lease

    def close(self) -> None:
        for ptr in self._registered:
            with contextlib.suppress(Exception):
                self._store.unregister_buffer(ptr)
        self._store.close()
