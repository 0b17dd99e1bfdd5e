"""The client's settings from constructor arguments, checked by ClientConfig's rules.

Their defaults are ClientConfig's fields, written there once: :data:`DEFAULTS` is read by
:func:`make_config` and by the keyword defaults of :class:`ClientConstructor`, the constructor
:class:`kvpool.Client` and :class:`kvpool.AsyncClient` share."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.config import ClientConfig
from kvpool.errors import ConfigError

DEFAULTS = ClientConfig()
"""Every client setting at its default (``masters`` aside: a client must name them)."""


SETTING_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(ClientConfig) if f.name != "masters"
)
"""Every client setting, by name: ClientConfig's fields (``masters`` aside)."""


def make_config(
    masters: Sequence[str] | str, *, env: Mapping[str, str] | None = None, **settings: Any
) -> ClientConfig:
    """A validated ClientConfig from constructor arguments (any of :data:`SETTING_NAMES`, the
    others at ClientConfig's defaults); ConfigError names every problem.

    ``masters`` is a list of ``host:port`` or one comma-separated string. The security
    settings left empty come from ``env`` (default: the process environment), as for every
    kvpool process: ``KVPOOL_CLUSTER_TOKEN``, ``KVPOOL_CLUSTER_TOKEN_FILE``, ``KVPOOL_TLS_*``.
    """
    unknown = sorted(set(settings) - set(SETTING_NAMES))
    if unknown:
        raise ConfigError(
            f"unknown client setting(s): {', '.join(unknown)} (the settings: "
            f"{', '.join(SETTING_NAMES)})"
        )
    given = {name: settings.get(name, getattr(DEFAULTS, name)) for name in SETTING_NAMES}
    env = os.environ if env is None else env
    if not (given["cluster_token"] or given["cluster_token_file"]):
        given["cluster_token"] = env.get("KVPOOL_CLUSTER_TOKEN", "")
        given["cluster_token_file"] = env.get("KVPOOL_CLUSTER_TOKEN_FILE", "")
    for setting in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name"):
        given[setting] = given[setting] or env.get("KVPOOL_" + setting.upper(), "")

    errors: list[str] = []
    addresses: tuple[str, ...] = ()
    if isinstance(masters, str):
        addresses = tuple(a.strip() for a in masters.split(",") if a.strip())
    elif isinstance(masters, Sequence) and all(isinstance(a, str) for a in masters):
        addresses = tuple(a.strip() for a in masters)
    else:
        errors.append("masters: expected a list of host:port strings or one comma-separated str")
    for name, default in ((n, getattr(DEFAULTS, n)) for n in SETTING_NAMES):
        value = given[name]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                errors.append(f"{name}: expected True or False, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                errors.append(f"{name}: expected a number ({_UNITS.get(name, '')}), got {value!r}")
            else:
                given[name] = float(value)
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                errors.append(f"{name}: expected an integer, got {value!r}")
        elif not isinstance(value, str):
            errors.append(f"{name}: expected a string, got {value!r}")
    if not errors:
        config = ClientConfig(masters=addresses, **given)
        errors = config.validate()
        if not errors:
            return config
    raise ConfigError("invalid client configuration:\n  " + "\n  ".join(errors))


_UNITS = {
    "timeout_s": "seconds",
    "lookup_cache_ttl_s": "seconds",
    "hedge_delay_ms": "milliseconds",
    "node_retry_ms": "milliseconds",
}


class ClientConstructor:
    """The constructor :class:`kvpool.Client` and :class:`kvpool.AsyncClient` share: every
    setting a keyword with ClientConfig's default; the class's ``_start`` takes the config."""

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
        node_retry_ms: float = DEFAULTS.node_retry_ms,
        metrics_port: int = DEFAULTS.metrics_port,
        metrics_host: str = DEFAULTS.metrics_host,
        cluster_token: str = DEFAULTS.cluster_token,
        cluster_token_file: str = DEFAULTS.cluster_token_file,
        tls_ca_file: str = DEFAULTS.tls_ca_file,
        tls_cert_file: str = DEFAULTS.tls_cert_file,
        tls_key_file: str = DEFAULTS.tls_key_file,
        tls_server_name: str = DEFAULTS.tls_server_name,
        direct_reads: str = DEFAULTS.direct_reads,
        busy_poll_us: int = DEFAULTS.busy_poll_us,
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
        ``node_retry_ms``: a node that failed a request (no connection, or no answer at all)
        is sent nothing for that long, then one request tries it again: meanwhile a read of
        a block held only there misses at once and a put goes to the next node on the ring
        (0: every call tries it, waiting out its deadline on a stopped node).
        ``metrics_port``: serve this client's Prometheus /metrics on ``metrics_host``
        (127.0.0.1; 0: any free port, see :attr:`metrics_address`; -1: off; an AsyncClient
        serves it from ``async with`` or ``start_metrics()``). ``max_tier`` (gpu, cpu, ssd):
        the slowest tier a get accepts when it does not say (empty: any). ``direct_reads``: a
        key the lookup cache lacks that names its content is read straight from the node the
        ring places it on, without a Lookup first (a miss there looks it up): ``scheme``
        (keys of :mod:`kvpool.keys`, the default), ``all`` (every key this client reads —
        say so only when a key never holds two different values: after a remove or an
        overwrite a node may still serve the earlier value), ``off``. ``busy_poll_us``
        (``Client`` only; 0, off, by default): wait for the answer to a read or a lookup by
        spinning that long before sleeping — on a machine whose idle CPUs are slow to wake
        (a VM without guest halt polling) it takes a wake-up off each call, at the price of
        the calling thread's CPU while it spins. Every default is
        :class:`~kvpool.config.ClientConfig`'s."""
        settings = {name: value for name, value in locals().items() if name in SETTING_NAMES}
        self._start(make_config(masters, **settings), strict=strict)

    def _start(self, config: ClientConfig, *, strict: bool) -> None:
        raise NotImplementedError
