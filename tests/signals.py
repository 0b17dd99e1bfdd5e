"""Signals for the children a test starts."""

from __future__ import annotations

import sys

CTRL_C_REACHES = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"
"""Python that makes SIGINT raise KeyboardInterrupt, as under a terminal.

A process started with SIGINT ignored — a background job of a non-interactive shell, as some CI
runners start their jobs — hands that on to its children, and a Python started so keeps ignoring
it (rightly: that is what its starter asked). A test that stops a child with SIGINT, as a user's
ctrl-c would, runs this in the child first so that it tests the program, not how CI started."""


def interruptible_module(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args...`` that ctrl-c reaches (see above)."""
    run = f"import runpy, sys; sys.argv[0] = {module!r}; runpy.run_module({module!r}, "
    run += "run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", f"{CTRL_C_REACHES}; {run}", *args]
