"""Structured logs: structlog, JSON when not on a terminal, key=value on one.

Every process calls :func:`configure_logging` once at start, then binds its identity
(``role``, ``node_id``) with :func:`bind_process`. A line logged inside a traced request carries
its ``trace_id`` and ``span_id`` (:func:`add_trace_ids`). Log events are short snake_case verbs
(``put_committed``, ``node_declared_down``); one line per lifecycle event.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
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
