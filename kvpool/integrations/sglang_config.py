"""The settings of kvpool's SGLang backend, from ``--hicache-storage-backend-extra-config``.

Every client setting of :class:`kvpool.Client` may be given there under its own name; the
backend adds ``namespace``. A bad value is refused when the backend is built, with the setting's
name; a name neither kvpool nor SGLang knows is logged (SGLang passes its own keys in the same
object).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.sync import Client
from kvpool.errors import ConfigError

WHERE = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)
CLIENT_KEYS = frozenset(
    name
    for name, p in inspect.signature(Client.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
DEFAULT_NAMESPACE = "sglang"
DEFAULT_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class BackendSettings:
    masters: tuple[str, ...]
    namespace: str = DEFAULT_NAMESPACE
    interface_v1: bool = False
    client: dict[str, Any] = field(default_factory=dict)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    """After the store failed (no master answered, or not within the deadline), it is left
    alone this long: ``batch_exists`` answers 0 and sets are dropped at once."""

    def make_client(self) -> Client:
        """The backend's client. SGLang's page keys name their content (a chained hash of the
        page's tokens, under the model and layout), so they are read straight from their
        node (``direct_reads="all"``) unless the extra config says otherwise."""
        try:
            return Client(list(self.masters), **{"direct_reads": "all", **self.client})
        except ConfigError as e:
            raise ConfigError(f"{WHERE}: {e}") from None


def _masters(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        out = tuple(m.strip() for m in value.split(",") if m.strip())
    elif isinstance(value, list | tuple) and all(isinstance(m, str) for m in value):
        out = tuple(m.strip() for m in value if m.strip())
    else:
        raise ConfigError(
            f"{WHERE}: masters: expected a list of host:port or one comma-separated string, "
            f"got {value!r}"
        )
    if not out:
        raise ConfigError(f"{WHERE}: masters: no address given")
    return out


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e6:
        raise ConfigError(f"{WHERE}: {name}: expected a number of seconds >= 0, got {value!r}")
    return float(value)


def parse_settings(extra: Mapping[str, Any], log: Any) -> BackendSettings:
    """The backend's settings; ConfigError names the first bad one."""
    if "masters" not in extra:
        raise ConfigError(
            f'{WHERE}: masters is required, e.g. "masters": ["10.0.0.1:7300", "10.0.0.2:7300"]'
        )
    masters = _masters(extra["masters"])
    namespace = extra.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace.strip("/ ") or "/" in namespace:
        raise ConfigError(f"{WHERE}: namespace: expected a non-empty name without '/'")
    retry_after_s = _seconds(extra.get("retry_after_s", DEFAULT_RETRY_AFTER_S), "retry_after_s")
    client = {k: v for k, v in extra.items() if k in CLIENT_KEYS}
    own = {"masters", "namespace", "retry_after_s"}
    unknown = sorted(k for k in extra if k not in CLIENT_KEYS | SGLANG_KEYS | own)
    if unknown:
        log.warning("kvpool_sglang_unknown_settings", settings=unknown, where=WHERE)
    settings = BackendSettings(
        masters, namespace.strip(), bool(extra.get("interface_v1", 0)), client, retry_after_s
    )
    # Check every client setting now, so that a typo fails the engine's start, not a call.
    settings.make_client().close()
    return settings
