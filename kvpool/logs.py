"""Structured logs: structlog, JSON when not on a terminal, key=value on one.

Every process calls :func:`configure_logging` once at start, then binds its identity
(``role``, ``node_id``) with :func:`bind_process`. A line logged inside a traced request carries
its ``trace_id`` and ``span_id`` (:func:`add_trace_ids`). Log events are short snake_case verbs
(``put_committed``, ``node_declared_down``); one line per lifecycle event.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

from kvpool.tracing import trace_ids

_PROCESS_FIELDS: dict[str, Any] = {}

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    """Set up structlog (and the stdlib root logger, for grpc and pysyncobj) for this process."""
    stream = stream or sys.stderr
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, not {level!r}")
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be json, console or auto, not {fmt!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            _add_process_fields,
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    # Libraries that log through the standard library (pysyncobj, grpc) go to the same stream.
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(stream)]
    root.setLevel(max(_LEVELS[level], logging.WARNING))


def _add_process_fields(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in _PROCESS_FIELDS.items():
        event.setdefault(key, value)
    return event


def add_trace_ids(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """``trace_id`` and ``span_id`` of the current OpenTelemetry span, on every line logged
    inside a traced request (nothing outside one)."""
    ids = trace_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


def bind_process(**fields: Any) -> None:
    """Attach fields (``role``, ``node_id``…) to every later log line of this process, from any
    thread (the Raft thread included)."""
    _PROCESS_FIELDS.update(fields)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()


class OncePer:
    """A warning logged at most once per ``period_s`` for each key (a peer, a reason): one bad
    peer sending thousands of bad frames costs one line per period, not one per frame. The
    lines held back are counted in the next one (``suppressed``). At most ``max_keys`` keys are
    remembered (the oldest forgotten first), so a scan from many addresses cannot grow it."""

    def __init__(
        self,
        log: Any,
        period_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        self._log = log
        self._period_s = period_s
        self._clock = clock
        self._max_keys = max_keys
        self._seen: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self.logged = 0
        self.suppressed = 0

    def warning(self, event: str, key: str, **fields: Any) -> bool:
        """Log ``event`` for ``key`` unless it was logged less than a period ago; True when
        logged."""
        now = self._clock()
        slot = (event, key)
        last = self._seen.get(slot)
        if last is not None and now - last[0] < self._period_s:
            self._seen[slot] = (last[0], last[1] + 1)
            self.suppressed += 1
            return False
        held = last[1] if last is not None else 0
        self._seen[slot] = (now, 0)
        self._seen.move_to_end(slot)
        while len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        self.logged += 1
        if held:
            fields["suppressed"] = held
        self._log.warning(event, **fields)
        return True
