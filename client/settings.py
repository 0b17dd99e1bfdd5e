"""The client's settings from constructor arguments, checked by ClientConfig's rules.

Their defaults are ClientConfig's fields, written there once: :data:`DEFAULTS` is read by
:func:`make_config` and by the keyword defaults of :class:`kvpool.Client` and
:class:`kvpool.AsyncClient`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from kvpool.config import ClientConfig
from kvpool.errors import ConfigError

DEFAULTS = ClientConfig()
"""Every client setting at its default (``masters`` aside: a client must name them)."""


def make_config(
    masters: Sequence[str] | str,
    *,
    timeout_s: float = DEFAULTS.timeout_s,
    replicas: int = DEFAULTS.replicas,
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
    env: Mapping[str, str] | None = None,
) -> ClientConfig:
    """A validated ClientConfig from constructor arguments; ConfigError names every problem.

    ``masters`` is a list of ``host:port`` or one comma-separated string. The security
    settings left empty come from ``env`` (default: the process environment), as for every
    kvpool process: ``KVPOOL_CLUSTER_TOKEN``, ``KVPOOL_CLUSTER_TOKEN_FILE``, ``KVPOOL_TLS_*``.
    """
    env = os.environ if env is None else env
    security = {
        "cluster_token": cluster_token,
        "cluster_token_file": cluster_token_file,
        "tls_ca_file": tls_ca_file,
        "tls_cert_file": tls_cert_file,
        "tls_key_file": tls_key_file,
        "tls_server_name": tls_server_name,
    }
    if not (cluster_token or cluster_token_file):
        security["cluster_token"] = env.get("KVPOOL_CLUSTER_TOKEN", "")
        security["cluster_token_file"] = env.get("KVPOOL_CLUSTER_TOKEN_FILE", "")
    for setting in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name"):
        security[setting] = security[setting] or env.get("KVPOOL_" + setting.upper(), "")

    errors: list[str] = []
    addresses: tuple[str, ...] = ()
    if isinstance(masters, str):
        addresses = tuple(a.strip() for a in masters.split(",") if a.strip())
    elif isinstance(masters, Sequence) and all(isinstance(a, str) for a in masters):
        addresses = tuple(a.strip() for a in masters)
    else:
        errors.append("masters: expected a list of host:port strings or one comma-separated str")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        errors.append(f"timeout_s: expected a number of seconds, got {timeout_s!r}")
    if isinstance(lookup_cache_ttl_s, bool) or not isinstance(lookup_cache_ttl_s, int | float):
        errors.append(
            f"lookup_cache_ttl_s: expected a number of seconds, got {lookup_cache_ttl_s!r}"
        )
    if not isinstance(hedge_reads, bool):
        errors.append(  # type: ignore[unreachable]  # callers without type checks
            f"hedge_reads: expected True or False, got {hedge_reads!r}"
        )
    for name, text in (
        ("max_tier", max_tier),
        ("transport", transport),
        ("metrics_host", metrics_host),
    ):
        if not isinstance(text, str):
            errors.append(  # type: ignore[unreachable]  # callers without type checks
                f"{name}: expected a string, got {text!r}"
            )
    if isinstance(hedge_delay_ms, bool) or not isinstance(hedge_delay_ms, int | float):
        errors.append(f"hedge_delay_ms: expected a number of milliseconds, got {hedge_delay_ms!r}")
    for name, value in (
        ("replicas", replicas),
        ("max_value_size", max_value_size),
        ("connections_per_node", connections_per_node),
        ("lookup_cache_size", lookup_cache_size),
        ("metrics_port", metrics_port),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{name}: expected an integer, got {value!r}")
    if not errors:
        config = ClientConfig(
            masters=addresses,
            timeout_s=float(timeout_s),
            replicas=replicas,
            max_value_size=max_value_size,
            connections_per_node=connections_per_node,
            max_tier=max_tier,
            transport=transport,
            lookup_cache_size=lookup_cache_size,
            lookup_cache_ttl_s=float(lookup_cache_ttl_s),
            hedge_reads=hedge_reads,
            hedge_delay_ms=float(hedge_delay_ms),
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            **security,
        )
        errors = config.validate()
        if not errors:
            return config
    raise ConfigError("invalid client configuration:\n  " + "\n  ".join(errors))
