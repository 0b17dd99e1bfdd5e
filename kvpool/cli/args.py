"""Command-line flags generated from the config dataclasses, so ``--help``, TOML keys and
``KVPOOL_*`` variables always name the same settings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.config import config_fields, load_config
from kvpool.errors import ConfigError, KVPoolError

C = TypeVar("C")


def add_config_flags(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """One flag per config field: ``cpu_cache_size`` → ``--cpu-cache-size``."""
    parser.add_argument(
        "--config",
        metavar="TOML",
        help="TOML file with settings (top level, or the section named after this process); "
        "flags override it, KVPOOL_<SETTING> variables sit in between",
    )
    group = parser.add_argument_group("settings (also TOML keys and KVPOOL_* variables)")
    for f, typ in config_fields(cls):
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help
        kind = f.metadata.get("kind", "")
        default = f.default
        if kind == "secret":
            shown = "(unset)" if not default else "(set)"
        elif isinstance(default, tuple):
            shown = ",".join(default) or "(none)"
        elif default == "":
            shown = "(unset)"
        else:
            shown = str(default)
        env = "KVPOOL_" + f.name.upper()
        if typ in (bool, bool | None):
            if default is None:
                shown = "auto"
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} [default: {shown}; env {env}]",
            )
        else:
            group.add_argument(
                flag,
                dest=f.name,
                default=None,
                metavar=kind.upper() or f.name.split("_")[-1].upper(),
                help=f"{help_text} [default: {shown}; env {env}]",
            )


def config_from_args(cls: type[C], args: argparse.Namespace, section: str) -> C:
    """Defaults < TOML (``--config``) < environment < flags; raises ConfigError."""
    overrides = {
        f.name: getattr(args, f.name)
        for f, _ in config_fields(cls)
        if getattr(args, f.name, None) is not None
    }
    return load_config(cls, toml_path=args.config, section=section, overrides=overrides)


def parse_forwarding(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; flags the parser does not know are an error unless the chosen subcommand
    sets ``forward_unknown`` (its own parser reads them): they are ``args.rest``."""
    args, unknown = parser.parse_known_args(list(argv))
    if unknown and not getattr(args, "forward_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.rest = unknown
    return args


def exit_status(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status; a ConfigError is bad usage (2) and any other KVPoolError a
    failure at run time (1), each printed as one line after ``prog``; Ctrl-C is 130, and a
    closed stdout (``... | head``) ends quietly."""
    try:
        return run()
    except ConfigError as e:
        print(f"{prog}: {e.message}", file=sys.stderr)
        return 2
    except KVPoolError as e:
        print(f"{prog}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
