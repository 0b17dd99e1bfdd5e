"""Checks of what nodes and clients ask the masters, before anything is proposed or read
(hostile-input hardening): a registration whose every field is valid, a read of a bounded
number of keys. A refused request raises a typed error and changes nothing."""

from __future__ import annotations

from kvpool.config import split_hostport
from kvpool.errors import MalformedRequestError, RequestTooLargeError
from kvpool.proto.v1 import master_pb2

MAX_NODE_ID_CHARS = 256
MAX_ZONE_CHARS = 64
MAX_ADDRESS_CHARS = 512
_HOST_SCHEMES = ("tcp", "rdma")
_NAME_SCHEMES = ("inproc",)  # in-process test nodes: a name, no host


def _printable(text: str) -> bool:
    return text.isprintable() and not any(c.isspace() for c in text)


def check_data_address(address: str) -> None:
    """``tcp://host:port`` (or ``rdma://host:port``; ``inproc://name`` for in-process tests)."""
    if len(address) > MAX_ADDRESS_CHARS or not _printable(address):
        raise MalformedRequestError(f"data_address {address[:100]!r}: not a data address")
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        raise MalformedRequestError(f"data_address {address[:100]!r}: expected tcp://host:port")
    if scheme in _NAME_SCHEMES:
        return
    if scheme not in _HOST_SCHEMES:
        raise MalformedRequestError(
            f"data_address {address[:100]!r}: unknown transport {scheme!r} (tcp, rdma)"
        )
    try:
        _, port = split_hostport(rest)
    except ValueError as e:
        raise MalformedRequestError(f"data_address: {e}") from None
    if port == 0:
        raise MalformedRequestError(f"data_address {address!r}: port 0")


def check_registration(request: master_pb2.RegisterNodeRequest, max_capacity: int) -> None:
    """Every field of a RegisterNode, or MalformedRequestError naming the first bad one."""
    node_id = request.node_id
    if not node_id or len(node_id) > MAX_NODE_ID_CHARS or not _printable(node_id):
        raise MalformedRequestError(
            f"node_id {node_id[:100]!r}: 1 to {MAX_NODE_ID_CHARS} printable characters"
        )
    if request.incarnation == 0:
        raise MalformedRequestError("incarnation 0 is reserved")
    check_data_address(request.data_address)
    if request.admin_address:
        try:
            split_hostport(request.admin_address[:MAX_ADDRESS_CHARS])
        except ValueError as e:
            raise MalformedRequestError(f"admin_address: {e}") from None
    if not 0 < request.capacity_bytes <= max_capacity:
        raise MalformedRequestError(
            f"capacity_bytes {request.capacity_bytes}: must be between 1 and "
            f"{max_capacity} (max_node_capacity)"
        )
    if len(request.zone) > MAX_ZONE_CHARS or (request.zone and not _printable(request.zone)):
        raise MalformedRequestError(
            f"zone {request.zone[:100]!r}: at most {MAX_ZONE_CHARS} printable characters"
        )


def check_key_count(count: int, limit: int, method: str) -> None:
    """Refuse a read of more than ``limit`` keys (it would hold the event loop too long)."""
    if count > limit:
        raise RequestTooLargeError(
            f"{method} of {count} keys; at most {limit} per request (max_lookup_keys): split it"
        )
