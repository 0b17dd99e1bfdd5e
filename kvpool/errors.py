"""One rooted exception tree, translated to and from gRPC status once, at the edge.

Every kvpool error has a stable ``code`` (sent as gRPC trailing metadata ``kvpool-error-code``)
and says whether retrying can help (``retryable``). A server raises these classes; the gRPC layer
(:mod:`kvpool.grpcutil`) maps them to a status code plus metadata; the client rebuilds the same
class from the metadata. A not-leader error carries the leader's gRPC address when known.

Bad input from the caller (a wrong key, an unsupported value type) raises even in non-strict mode:
it is a bug in the caller, not a failure of the cache. Failures of the cache (a node down, a
timeout, a checksum mismatch) become a miss unless the caller asked for strict mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import grpc

ERROR_CODE_KEY = "kvpool-error-code"
LEADER_KEY = "kvpool-leader"
PROTOCOL_VERSION_KEY = "kvpool-protocol-version"


class _GrpcStatus:
    """``cls.grpc_status``: the ``grpc.StatusCode`` named by ``cls.grpc_status_name``.

    Looked up when read, so that importing this module does not import grpc (~50 ms): the
    processes and tools that only raise or catch these errors never pay for the transport.
    """

    def __get__(self, obj: object, owner: type[KVPoolError]) -> grpc.StatusCode:
        import grpc

        return getattr(grpc.StatusCode, owner.grpc_status_name)


class KVPoolError(Exception):
    """Root of every error kvpool raises on purpose."""

    code: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False
    # The gRPC status a server answers with, by name (grpc.StatusCode member); read it as
    # ``grpc_status`` to get the StatusCode itself.
    grpc_status_name: ClassVar[str] = "INTERNAL"
    grpc_status = _GrpcStatus()

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()


# --- caller errors: bad input, raised in every mode -------------------------------------------


class InvalidArgumentError(KVPoolError, ValueError):
    """An argument the caller passed is not acceptable."""

    code = "INVALID_ARGUMENT"
    grpc_status_name = "INVALID_ARGUMENT"


class InvalidKeyError(InvalidArgumentError):
    """A key is empty, too long, or not a string."""

    code = "INVALID_KEY"


class InvalidValueError(InvalidArgumentError, TypeError):
    """A value is of an unsupported type (use bytes, bytearray, memoryview or a numpy array)."""

    code = "INVALID_VALUE"


class ValueTooLargeError(InvalidArgumentError):
    """A value is larger than the largest block kvpool accepts."""

    code = "VALUE_TOO_LARGE"


class BufferTooSmallError(InvalidArgumentError):
    """The buffer passed to get_into is smaller than the block."""

    code = "BUFFER_TOO_SMALL"


class ConfigError(InvalidArgumentError):
    """A configuration value is invalid; the message names it."""

    code = "CONFIG"


# --- protocol ------------------------------------------------------------------------------


class ProtocolVersionError(KVPoolError):
    """The peer speaks another kvpool protocol version."""

    code = "PROTOCOL_VERSION"
    grpc_status_name = "FAILED_PRECONDITION"


class MalformedRequestError(KVPoolError):
    """A request is malformed (the server kept serving)."""

    code = "MALFORMED"
    grpc_status_name = "INVALID_ARGUMENT"


class RequestTooLargeError(MalformedRequestError):
    """A request is above a server's limit (too many keys, too many bytes): split it."""

    code = "REQUEST_TOO_LARGE"


# --- cluster state: retryable -----------------------------------------------------------------


class NotLeaderError(KVPoolError):
    """This master is not the Raft leader; retry on the leader."""

    code = "NOT_LEADER"
    retryable = True
    grpc_status_name = "FAILED_PRECONDITION"

    def __init__(self, message: str = "", leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader or None


class NotCaughtUpError(KVPoolError):
    """This master has not applied the revision the caller asked for yet."""

    code = "NOT_CAUGHT_UP"
    retryable = True
    grpc_status_name = "UNAVAILABLE"


class UnavailableError(KVPoolError):
    """No master or node could answer (unreachable, no leader, no quorum)."""

    code = "UNAVAILABLE"
    retryable = True
    grpc_status_name = "UNAVAILABLE"


class UnauthenticatedError(KVPoolError):
    """The caller did not prove it belongs to this cluster (a missing or wrong cluster token,
    or no client certificate where the server requires one)."""

    code = "UNAUTHENTICATED"
    grpc_status_name = "UNAUTHENTICATED"


class DeadlineExceededError(KVPoolError, TimeoutError):
    """The call's deadline passed before it completed."""

    code = "DEADLINE_EXCEEDED"
    retryable = True
    grpc_status_name = "DEADLINE_EXCEEDED"


class StaleRingError(KVPoolError):
    """The client placed blocks on an outdated ring; refresh the members and place again."""

    code = "STALE_RING"
    retryable = True
    grpc_status_name = "ABORTED"

    def __init__(self, message: str = "", ring_version: int = 0) -> None:
        super().__init__(message)
        self.ring_version = ring_version


class NoNodesError(KVPoolError):
    """No live store node is registered."""

    code = "NO_NODES"
    retryable = True
    grpc_status_name = "UNAVAILABLE"


class NoSpaceError(KVPoolError):
    """A store node could not make room for a block."""

    code = "NO_SPACE"
    retryable = True
    grpc_status_name = "RESOURCE_EXHAUSTED"


class IndexFullError(KVPoolError):
    """The index holds as many entries as its masters allow (``index_max_entries``): puts of
    keys it does not hold are refused until blocks leave it (evicted, removed), so that the
    masters, which all hold the whole index, are never killed for memory at once. Overwrites
    of keys it holds go on. A put refused for it is a miss (False) unless strict."""

    code = "INDEX_FULL"
    grpc_status_name = "RESOURCE_EXHAUSTED"


class UnknownMemberError(KVPoolError):
    """The index does not know this node incarnation as live; register again."""

    code = "UNKNOWN_MEMBER"
    grpc_status_name = "NOT_FOUND"


class NodeDrainedError(KVPoolError):
    """This node process was drained and declared left; it does not rejoin the cluster until
    its process restarts (a new incarnation)."""

    code = "NODE_DRAINED"
    grpc_status_name = "FAILED_PRECONDITION"


class PinQuotaExceededError(InvalidArgumentError):
    """Pinning these keys would exceed the masters' pin quota (``pin_quota``: bytes, counted as
    size x replicas over pinned keys). Unpin something, pin fewer replicas, or raise the quota."""

    code = "PIN_QUOTA_EXCEEDED"
    grpc_status_name = "RESOURCE_EXHAUSTED"


# --- data errors: become a miss unless strict ---------------------------------------------------


class BlockMissError(KVPoolError, KeyError):
    """The block is not in the cache (absent, evicted, or its node is down)."""

    code = "MISS"
    grpc_status_name = "NOT_FOUND"

    def __init__(self, message: str = "", reason: str = "absent") -> None:
        super().__init__(message)
        self.reason = reason

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class ChecksumMismatchError(KVPoolError):
    """The bytes read do not match the checksum stored at put time."""

    code = "CHECKSUM_MISMATCH"
    retryable = True
    grpc_status_name = "DATA_LOSS"


class TransportError(KVPoolError):
    """A data-plane connection failed or a peer sent a bad frame."""

    code = "TRANSPORT"
    retryable = True
    grpc_status_name = "UNAVAILABLE"


class InternalError(KVPoolError):
    """An unexpected server-side error; the server kept serving."""

    code = "INTERNAL"


def _all_subclasses(cls: type[KVPoolError]) -> list[type[KVPoolError]]:
    out: list[type[KVPoolError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[KVPoolError]] = {
    cls.code: cls for cls in _all_subclasses(KVPoolError)
}
ERRORS_BY_CODE.setdefault("INTERNAL", InternalError)

# By grpc.StatusCode member name (see KVPoolError.grpc_status_name).
_STATUS_FALLBACK: dict[str, type[KVPoolError]] = {
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "INVALID_ARGUMENT": MalformedRequestError,
    "RESOURCE_EXHAUSTED": NoSpaceError,
    "CANCELLED": UnavailableError,
    "UNIMPLEMENTED": ProtocolVersionError,
    "UNAUTHENTICATED": UnauthenticatedError,
}


def error_from_code(
    code: str | None,
    message: str,
    *,
    status: grpc.StatusCode | None = None,
    leader: str | None = None,
) -> KVPoolError:
    """Rebuild the error a server raised from its code (or, lacking one, its gRPC status)."""
    cls = ERRORS_BY_CODE.get(code or "")
    if cls is None:
        name = getattr(status, "name", None)
        cls = _STATUS_FALLBACK.get(name, InternalError) if isinstance(name, str) else InternalError
    if cls is NotLeaderError:
        return NotLeaderError(message, leader=leader)
    return cls(message)
