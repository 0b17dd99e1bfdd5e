"""The ``kvpool-bench peers`` command line: flags to :class:`~kvpool_bench.peers.PeersOptions`,
the run, and the table, JSON and Markdown it writes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.units import parse_size
from kvpool_bench import report
from kvpool_bench.peers import PeersOptions, run_peers


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def options_from_args(args: Any) -> PeersOptions:
    """PeersOptions from ``kvpool-bench peers`` flags (quick defaults under --quick)."""
    overrides: dict[str, Any] = {}
    try:
        if args.sizes:
            overrides["sizes"] = tuple(parse_size(s) for s in _csv(args.sizes))
        if args.clients:
            overrides["clients"] = tuple(int(c) for c in _csv(args.clients))
    except ValueError as e:
        raise ConfigError(f"kvpool-bench peers: {e}") from None
    if getattr(args, "arena", None):
        try:
            overrides["arena_bytes"] = parse_size(args.arena)
        except ValueError as e:
            raise ConfigError(f"kvpool-bench peers: --arena: {e}") from None
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    if args.modes:
        overrides["modes"] = tuple(_csv(args.modes))
    if getattr(args, "engine_batch", None) is not None:
        overrides["engine_batch_keys"] = args.engine_batch
    if args.peers is not None:
        overrides["peers"] = tuple(p for p in _csv(args.peers) if p != "none")
    if args.kvpool_transports:
        overrides["kvpool_transports"] = tuple(_csv(args.kvpool_transports))
    overrides["kvpool_api"] = args.kvpool_api
    overrides["kvpool_busy_poll_us"] = getattr(args, "kvpool_busy_poll_us", 0) or 0
    overrides["kvpool_masters"] = args.kvpool_masters
    overrides["kvpool_nodes"] = args.kvpool_nodes
    overrides["kvpool_in_memory"] = args.kvpool_in_memory
    overrides["gc_freeze"] = bool(getattr(args, "gc_freeze", False))
    overrides["directory"] = args.dir
    overrides["seed"] = args.seed
    if args.quick:
        return PeersOptions.quick_run(**overrides)
    return replace(PeersOptions(), **overrides)


def main_peers(args: Any) -> int:
    """``kvpool-bench peers``: 0 done, 1 a wrong read, a kvpool hand-off miss, or kvpool
    could not be measured."""
    import json

    opts = options_from_args(args)
    doc = run_peers(opts, stderr_progress)
    text = json.dumps(doc, indent=2, default=str)
    if args.json == "-":
        print(text)
    else:
        if args.json:
            Path(args.json).write_text(text + "\n")
        print(report.render_table(doc))
        if args.json:
            print(f"\nall numbers: {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(report.render_markdown(doc))
    kvpool_ok = any(
        s["status"] == "measured" for n, s in doc["systems"].items() if report.is_kvpool(n)
    )
    handoff_miss = any(c["misses"] for c in doc["handoffs"] if report.is_kvpool(c["system"]))
    ok = kvpool_ok and doc["verification"]["wrong"] == 0 and not handoff_miss
    return 0 if ok else 1
