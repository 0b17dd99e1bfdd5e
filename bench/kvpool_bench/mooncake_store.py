"""The Mooncake Store process of ``kvpool-bench peers``: one ``MooncakeDistributedStore`` that
contributes a memory segment (``setup`` with a global segment size) and serves it until it is
told to stop (SIGTERM / SIGINT) or its parent goes away.

    python -m kvpool_bench.mooncake_store --master 127.0.0.1:PORT \\
        --segment-bytes 1073741824 --ready-file DIR/mooncake-store.ready

The benchmark clients contribute no segment, so every byte they put or get crosses from their
process to this one over Mooncake's TCP transport. Exit codes: 0 stopped, 1 setup failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool_bench.mooncake_store")
    parser.add_argument("--master", required=True, help="mooncake_master RPC address")
    parser.add_argument("--segment-bytes", type=int, required=True, help="segment to contribute")
    parser.add_argument("--local-buffer-bytes", type=int, default=16 << 20)
    parser.add_argument("--ready-file", required=True, help="written once the segment is up")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()

    store_mod: Any = importlib.import_module("mooncake.store")
    store = store_mod.MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1",
        "P2PHANDSHAKE",
        args.segment_bytes,
        args.local_buffer_bytes,
        "tcp",
        "",
        args.master,
    )
    if rc != 0:
        print(f"mooncake store: setup returned {rc}", file=sys.stderr, flush=True)
        return 1
    ready = Path(args.ready_file)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "segment_bytes": args.segment_bytes}))
    tmp.replace(ready)
    while not stop.wait(0.5):
        if os.getppid() != parent:  # the bench died without stopping us
            break
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
