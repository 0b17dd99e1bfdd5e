"""The two clients answer the same operations: each is written once in ``kvpool.client.api``,
and ``Client`` carries it out in the caller's thread while ``AsyncClient`` makes a coroutine of
it, with the same signature and document."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvpool import AsyncClient, Client
from kvpool.client import api
from kvpool.errors import InvalidArgumentError, UnavailableError

MASTERS = ["127.0.0.1:1"]
"""Nothing listens there: the calls below fail before any is asked."""
WRITTEN_PER_DRIVER = ("batch_get_alloc", "get_or_compute")
"""The two operations each driver writes out (see docs/client.md)."""


@pytest.mark.parametrize("name", sorted({*api.__all__, *WRITTEN_PER_DRIVER}))
def test_both_clients_have_each_operation_with_one_signature(name: str) -> None:
    sync, awaited = getattr(Client, name), getattr(AsyncClient, name)
    assert not inspect.iscoroutinefunction(sync)
    assert inspect.iscoroutinefunction(awaited)
    sync_params = list(inspect.signature(sync).parameters.values())
    async_params = list(inspect.signature(awaited).parameters.values())
    assert [(p.name, p.kind, p.default) for p in sync_params] == [
        (p.name, p.kind, p.default) for p in async_params
    ]
    assert sync_params[0].name == "self"
    if name not in WRITTEN_PER_DRIVER:
        built = getattr(api, name)
        assert sync.__doc__ == awaited.__doc__ == built.__doc__
        assert sync.__name__ == awaited.__name__ == name
        assert [p.name for p in sync_params[1:]] == list(inspect.signature(built).parameters)[1:]


def test_the_two_clients_have_the_same_public_names_but_start_metrics() -> None:
    sync = {n for n in dir(Client) if not n.startswith("_")}
    awaited = {n for n in dir(AsyncClient) if not n.startswith("_")}
    assert {*api.__all__, *WRITTEN_PER_DRIVER} <= sync
    # An AsyncClient serves /metrics from ``async with`` (or start_metrics); a Client from
    # its constructor, in a thread.
    assert awaited ^ sync == {"start_metrics"}


def test_an_operation_checks_its_input_and_the_clients_state_in_both_clients() -> None:
    kv = Client(MASTERS)
    with pytest.raises(InvalidArgumentError):
        kv.get("")
    with pytest.raises(InvalidArgumentError):
        kv.pin(["k"], replicas=-1)
    assert kv.batch_get([]) == []
    assert kv.batch_put([]) == []
    kv.close()
    with pytest.raises(UnavailableError, match="closed"):
        kv.put("k", b"v")

    async def run() -> None:
        async with AsyncClient(MASTERS) as akv:
            with pytest.raises(InvalidArgumentError):
                await akv.get("")
            assert await akv.batch_get([]) == []
            assert await akv.batch_put([]) == []
        with pytest.raises(UnavailableError, match="closed"):
            await akv.exists("k")

    asyncio.run(run())
