"""``kvpool node drain``: hand every block a store node holds to other nodes, then make it leave.

    kvpool node drain NODE_ID --masters host:port,...          # waits until it has left
    kvpool node drain NODE_ID --masters host:port,... --cancel # it takes puts again

(``kvpool node`` with no action runs a store node; ``drain`` is its one action.) The command asks
any master, follows the leader, and re-asks through a master failover until the node has left
or ``--timeout`` passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DESCRIPTION = (
    "Make a store node hand every block it holds to other nodes, then leave the cluster "
    "(declared left; stop its process afterwards: it does not rejoin until restarted). The "
    "draining mark is replicated: clients stop placing puts on the node at once, and the drain "
    "carries on through a master failover."
)

_STOP_NOW = (
    "node {node}: its process may be stopped now; until then it holds nothing and does not "
    "rejoin (only a restart of the process joins it again, as a new empty member)"
)


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpool node drain``."""
    parser.add_argument(
        "node_id", metavar="NODE_ID", help="the node's id (as `kvpool status` lists it)"
    )
    parser.add_argument(
        "--masters",
        required=True,
        metavar="HOST:PORT,...",
        help="master gRPC addresses, comma-separated (any; the leader is found)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds to wait for the node to have left (or, with --cancel, for a master to "
        "take the cancel) before giving up with exit status 1 [300]",
    )
    parser.add_argument(
        "--cancel",
        action="store_true",
        help="stop a drain in progress: clear the mark, the node takes puts again",
    )


def call_master(address: str, method: str, request: Any, timeout_s: float = 10.0) -> Any:
    """One master call, with the cluster token and TLS from the environment (KVPOOL_*)."""
    from kvpool.grpcutil import call_once_sync
    from kvpool.proto.v1 import master_pb2_grpc
    from kvpool.security import env_security

    return call_once_sync(
        address,
        master_pb2_grpc.MasterStub,
        method,
        request,
        timeout_s=timeout_s,
        security=env_security(),
    )


def drain(args: argparse.Namespace) -> int:
    """Run ``kvpool node drain``: 0 once the node has left (or the cancel was taken), else 1."""
    from kvpool.errors import KVPoolError, UnknownMemberError
    from kvpool.proto.v1 import master_pb2

    masters = [a for a in args.masters.split(",") if a]
    deadline = time.monotonic() + args.timeout
    last_error = ""
    asked = False  # a master accepted the drain: the node is marked draining in the index
    while time.monotonic() < deadline:
        for address in masters:
            try:
                response = call_master(
                    address,
                    "DrainNode",
                    master_pb2.DrainNodeRequest(
                        node_id=args.node_id, wait=not args.cancel, cancel=args.cancel
                    ),
                    timeout_s=max(1.0, min(30.0, deadline - time.monotonic())),
                )
            except UnknownMemberError as e:
                if asked:  # drained and declared left while we re-asked (a failover)
                    print(f"node {args.node_id}: left the cluster")
                    print(_STOP_NOW.format(node=args.node_id))
                    return 0
                print(f"kvpool node drain: {e.message}", file=sys.stderr)
                return 1
            except KVPoolError as e:
                last_error = e.message
                continue
            if args.cancel:
                print(f"node {args.node_id}: drain cancelled, {response.blocks_left} blocks on it")
                return 0
            asked = True
            print(
                f"node {args.node_id}: {response.blocks_left} blocks left"
                + (", left the cluster" if response.left else "")
            )
            if response.left:
                print(_STOP_NOW.format(node=args.node_id))
                return 0
            break
        time.sleep(0.5)
    what = "not cancelled" if args.cancel else "not drained in time"
    print(f"kvpool node drain: {what} ({last_error})", file=sys.stderr)
    return 1
