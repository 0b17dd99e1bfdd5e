"""Settings an engine hands a kvpool backend, checked once, each error naming the setting.

Engines pass their backend a loose dict (vLLM's ``kv_connector_extra_config``, LMCache's
``extra_config`` and ``remote_url``). :func:`read_settings` turns one into typed values against a
table of known names, so that a typo (``mastrs``) or a wrong type is refused at start with the
setting's full name, never ignored until the first request misses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.state import WarmUp
from kvpool.client.sync import Client
from kvpool.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class StoreSettings:
    """How a backend reaches the pool: the masters, the deadline of each call, security."""

    masters: tuple[str, ...]
    timeout_s: float = 1.0
    """Deadline of each store call: a slower or failed call is a miss (recompute)."""
    retry_after_s: float = 5.0
    """After the store failed, it is left alone this long (no request waits on a dead store)."""
    transport: str = "auto"
    cluster_token: str = ""
    cluster_token_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    extras: Mapping[str, Any] = field(default_factory=dict)
    """The engine-specific settings of the same dict, already checked by the caller's table."""

    def client(self, *, strict: bool = True) -> Client:
        """A :class:`kvpool.Client` for these settings (security settings left empty come from
        the ``KVPOOL_*`` environment variables, as for every kvpool process)."""
        return Client(
            list(self.masters),
            timeout_s=self.timeout_s,
            strict=strict,
            transport=self.transport,
            cluster_token=self.cluster_token,
            cluster_token_file=self.cluster_token_file,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
            tls_server_name=self.tls_server_name,
        )


def warm_up(client: Client, log: Any, *, nodes: bool = True, **context: Any) -> WarmUp:
    """Open ``client``'s connections now, while the engine starts, so that its first request
    does not pay for them (tens of milliseconds, more over shared memory); what could not be
    opened is logged, and the calls open it later. ``nodes=False``: the masters' only. The
    report says whether a master answered (``masters`` empty)."""
    report = client.warm_up(nodes=nodes)
    event = "kvpool_warmed_up" if report.ok else "kvpool_warm_up_incomplete"
    (log.info if report.ok else log.warning)(event, detail=report.summary(), **context)
    return report


STORE_SETTINGS: dict[str, str] = {
    "masters": "masters",
    "timeout_s": "seconds",
    "retry_after_s": "seconds",
    "transport": "str",
    "cluster_token": "str",
    "cluster_token_file": "str",
    "tls_ca_file": "str",
    "tls_cert_file": "str",
    "tls_key_file": "str",
    "tls_server_name": "str",
}
"""The settings every backend takes, with their kind."""


def parse_masters(value: object, name: str) -> tuple[str, ...]:
    """``host:port`` addresses from a list or a comma-separated string."""
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        items = [str(part).strip() for part in value]
    else:
        raise ConfigError(f"{name}: expected host:port addresses (a list or 'h:p,h:p')")
    items = [item for item in items if item]
    if not items:
        raise ConfigError(f"{name}: no master address given (expected 'host:port,...')")
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name}: {item!r} is not host:port")
    return tuple(items)


def convert(kind: str, value: object, name: str) -> Any:
    """``value`` as a setting of ``kind`` (str, int, bool, seconds, masters)."""
    if kind == "masters":
        return parse_masters(value, name)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {type(value).__name__}")
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if number < 1:
            raise ConfigError(f"{name}: must be at least 1, got {number}")
        return number
    if kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(f"{name}: expected seconds (a number), got {value!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigError(f"{name}: expected seconds (a number), got {value!r}") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ConfigError(f"{name}: must be a positive number of seconds, got {value!r}")
        return seconds
    raise AssertionError(f"unknown setting kind {kind!r}")


def read_settings(
    raw: Mapping[str, Any],
    *,
    where: str,
    extra_kinds: Mapping[str, str] | None = None,
    masters: object = None,
) -> StoreSettings:
    """Check ``raw`` against the store settings plus ``extra_kinds`` (name → kind).

    ``where`` prefixes every error (``kv_connector_extra_config``); ``masters``, when given,
    is used if ``raw`` has none (LMCache's ``remote_url``). Unknown names are refused."""
    kinds = dict(STORE_SETTINGS)
    kinds.update(extra_kinds or {})
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in kinds:
            known = ", ".join(sorted(kinds))
            raise ConfigError(f"{where}[{key!r}]: unknown setting (known: {known})")
        values[key] = convert(kinds[key], value, f"{where}[{key!r}]")
    if "masters" not in values:
        if masters is None:
            raise ConfigError(
                f"{where}['masters']: required: the kvpool masters as 'host:port,host:port'"
            )
        values["masters"] = parse_masters(masters, f"{where}['masters']")
    store = {k: v for k, v in values.items() if k in STORE_SETTINGS}
    extras = {k: v for k, v in values.items() if k not in STORE_SETTINGS}
    transport = store.get("transport", "auto")
    if transport not in ("auto", "tcp", "shm"):
        raise ConfigError(f"{where}['transport']: expected auto, tcp or shm, got {transport!r}")
    return StoreSettings(**store, extras=extras)
