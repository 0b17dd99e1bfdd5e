"""The client's settings are ClientConfig's: every field is a keyword of ``Client``,
``AsyncClient`` and ``make_config`` with the field's default, and a client built without them
runs on exactly ClientConfig's defaults."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import AsyncClient, Client
from kvpool.client.core import ClientCore
from kvpool.client.settings import make_config
from kvpool.config import ClientConfig
from kvpool.errors import ConfigError

MASTERS = ["127.0.0.1:1"]
"""Nothing listens there: building a client asks no master."""
SETTINGS = {f.name: f.default for f in dataclasses.fields(ClientConfig) if f.name != "masters"}
CONSTRUCTORS: list[Callable[..., Any]] = [Client.__init__, AsyncClient.__init__]


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "KVPOOL_CLUSTER_TOKEN",
        "KVPOOL_CLUSTER_TOKEN_FILE",
        "KVPOOL_TLS_CA_FILE",
        "KVPOOL_TLS_CERT_FILE",
        "KVPOOL_TLS_KEY_FILE",
        "KVPOOL_TLS_SERVER_NAME",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("constructor", CONSTRUCTORS, ids=lambda c: c.__qualname__)
def test_every_setting_is_a_keyword_with_client_configs_default(
    constructor: Callable[..., Any],
) -> None:
    params = inspect.signature(constructor).parameters
    keywords = {
        name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert {name: keywords.get(name, "<missing>") for name in SETTINGS} == SETTINGS
    # Nothing else but the call-level flags, which are not settings of the config.
    assert set(keywords) - set(SETTINGS) <= {"strict"}


def test_make_config_takes_every_setting_by_name_and_refuses_others() -> None:
    assert make_config(MASTERS) == ClientConfig(masters=tuple(MASTERS))
    assert make_config(MASTERS, replicas=2, hedge_reads=False).replicas == 2
    with pytest.raises(ConfigError, match=r"unknown client setting.*replica\b"):
        make_config(MASTERS, replica=2)
    with pytest.raises(TypeError, match="timeout"):
        Client(MASTERS, timeout=3.0)  # type: ignore[call-arg]
    with pytest.raises(ConfigError) as bad:
        make_config(MASTERS, timeout_s="2", hedge_reads=1, transport=3, replicas=1.5)
    for name in ("timeout_s", "hedge_reads", "transport", "replicas"):
        assert name in str(bad.value)


def test_a_sync_client_built_with_no_settings_runs_on_client_configs_defaults() -> None:
    with Client(MASTERS) as kv:
        assert kv.config == ClientConfig(masters=tuple(MASTERS))


def test_an_async_client_built_with_no_settings_runs_on_client_configs_defaults() -> None:
    async def build() -> ClientConfig:
        async with AsyncClient(MASTERS) as kv:
            return kv.config

    assert asyncio.run(build()) == ClientConfig(masters=tuple(MASTERS))


@pytest.mark.parametrize("client", [Client, AsyncClient])
def test_max_tier_and_metrics_host_reach_the_config(client: Callable[..., Any]) -> None:
    kv = client(MASTERS, max_tier="cpu", metrics_host="::1")
    try:
        config = kv.config
        assert (config.max_tier, config.metrics_host) == ("cpu", "::1")
    finally:
        if isinstance(kv, Client):
            kv.close()
        else:
            asyncio.run(kv.close())


def test_an_async_client_serves_metrics_when_asked() -> None:
    async def scrape() -> tuple[str, str]:
        async with AsyncClient(MASTERS, metrics_port=0) as kv:
            address = kv.metrics_address
            assert await kv.start_metrics() == address  # started once
            text = await asyncio.to_thread(_get, f"http://{address}/metrics")
        return address, text

    address, text = asyncio.run(scrape())
    assert address.startswith("127.0.0.1:")
    assert "kvpool_client_" in text


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def test_an_async_client_says_it_does_not_busy_poll() -> None:
    said: list[tuple[str, str]] = []

    class Log:
        def warning(self, event: str, **fields: Any) -> None:
            said.append((event, fields["setting"]))

        def __getattr__(self, _name: str) -> Callable[..., None]:
            return lambda *_args, **_fields: None

    async def build(**settings: Any) -> None:
        core = ClientCore(make_config(MASTERS, **settings), logger=Log())
        await core.close()

    asyncio.run(build())
    assert said == []
    asyncio.run(build(busy_poll_us=300))
    assert said == [("client_setting_ignored", "busy_poll_us")]
