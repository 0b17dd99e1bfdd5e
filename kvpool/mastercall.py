"""Calling the master group: leader discovery, redirects, retries inside one deadline.

Used by the client SDK and by store nodes. Written once, without I/O: :class:`CallPlan` decides
each attempt (ask this master for so long, follow a redirect, back off, give up), and
:class:`MasterCall` makes it (over the master's frame RPC port, or gRPC) and reads the answer;
two thin drivers do the I/O: :class:`MasterClient` from an event loop (``grpc.aio``),
:class:`SyncMasterClient` in the caller's thread (sync gRPC: the synchronous client's fast
path, which has no loop to hop to). Both keep their leader knowledge in one
:class:`MasterRouting`, which a client shares between them. Writes go to the leader: a follower
answers NOT_LEADER with the leader's address, which becomes the preferred master. Lookups and
prefix matches go to the leader too (:data:`LEADER_READS`): masters answer them there only,
under a read lease, so that every acknowledged write is found. Every retry stays inside the
caller's deadline (``loop.time()`` based); one attempt never takes more than
``attempt_timeout_s`` so a paused master cannot eat the whole budget.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from kvpool import tracing
from kvpool.errors import (
    DeadlineExceededError,
    KVPoolError,
    NotCaughtUpError,
    NotLeaderError,
    UnauthenticatedError,
    UnavailableError,
    error_from_code,
)
from kvpool.grpcutil import call_metadata, create_channel, create_sync_channel, unary, unary_sync
from kvpool.proto.v1 import master_pb2, master_pb2_grpc
from kvpool.proto.wire import Op, Status
from kvpool.security import NO_SECURITY, Security
from kvpool.transports.auth import authenticate_blocking
from kvpool.transports.blocking import BlockingConnection, connect_tcp_blocking, time_left
from kvpool.transports.calls import Call, owned_bytes
from kvpool.transports.tcp import ConnectionPool, FrameConnection, open_tcp_address
from kvpool.transports.threads import ThreadConnections

FAILED_HOLD_S = 1.0
"""How long a master whose call failed (down, paused, unreachable) is not asked again while
another master can be."""

READ_PORT_HOLD_S = 30.0
"""How long a read port that refused or dropped a call is left for the RPC port (which serves
the same reads) before it is tried again: a read port full for a moment (``read_threads``) is
used again once it has room."""

LEADER_READS = frozenset({"Lookup", "PrefixMatch"})
"""Reads the masters answer on the leader only: a success there names the leader."""


class Backoff:
    """Exponential backoff with full jitter, capped (``rng``: a seeded one for tests)."""

    def __init__(
        self, base_s: float = 0.02, cap_s: float = 0.5, *, rng: random.Random | None = None
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempt = 0
        self._uniform = rng.uniform if rng is not None else random.uniform

    def next_delay(self) -> float:
        delay = min(self.cap_s, self.base_s * (2**self.attempt))
        self.attempt += 1
        return self._uniform(0, delay)


class MasterRouting:
    """Which master to ask first: the known leader, then the others in rotation; redirects
    learned from NOT_LEADER answers. Shared by the async and the sync caller of one client.
    ``clock`` times the hold of failed masters (``time.monotonic``; a fake one in tests)."""

    def __init__(
        self, addresses: Sequence[str], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not addresses:
            raise UnavailableError("no master addresses given")
        self._addresses: list[str] = list(dict.fromkeys(addresses))
        self.leader: str | None = None
        self._rotation = 0
        self._lock = threading.Lock()
        self._rpc: dict[str, str] = {}  # gRPC address -> its frame RPC port ("" = none)
        self._read: dict[str, str] = {}  # gRPC address -> its read port (none: not offered)
        self._read_held: dict[str, float] = {}  # gRPC address -> when its read port failed
        self._failed_at: dict[str, float] = {}  # address -> when a call to it last failed
        self._clock = clock

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def rpc_of(self, address: str) -> str | None:
        """The frame RPC port of the master at ``address``: "" when it has none, None when
        not known yet."""
        return self._rpc.get(address)

    def read_of(self, address: str) -> str:
        """The read port of the master at ``address`` (its index reads, served by threads:
        ``read_address`` in GetMembers), or "" when none is known or it failed a call in
        the last ``READ_PORT_HOLD_S``."""
        held = self._read_held.get(address)
        if held is not None and self._clock() - held < READ_PORT_HOLD_S:
            return ""
        return self._read.get(address, "")

    def learn_rpc(self, address: str, rpc_address: str, read_address: str = "") -> None:
        self._rpc[address] = rpc_address
        self._read_held.pop(address, None)
        if read_address:
            self._read[address] = read_address
        else:
            self._read.pop(address, None)

    def forget_rpc(self, address: str, rpc_address: str) -> None:
        """The RPC port (or read port) learned for ``address`` refused or dropped us: learn it
        again next time (a restarted master listens on another one). A read port is left for
        ``READ_PORT_HOLD_S`` (the RPC port serves the same reads), then tried again: it may
        have been full for a moment (``read_threads``)."""
        if self._read.get(address) == rpc_address:
            self._read_held[address] = self._clock()
        elif self._rpc.get(address) == rpc_address:
            self._rpc.pop(address, None)  # threads may forget it at once
            self._read.pop(address, None)

    def _failed_lately(self, address: str, now: float) -> bool:
        return now - self._failed_at.get(address, -FAILED_HOLD_S) < FAILED_HOLD_S

    def order(self) -> list[str]:
        """Addresses to try: the leader first when known, then the others, rotating; a master
        that failed a call in the last ``FAILED_HOLD_S`` is left out while another is there to
        ask (a paused leader must not cost every retry a whole attempt while the others elect
        a new one; they name it until they have)."""
        now = self._clock()
        with self._lock:
            n = len(self._addresses)
            self._rotation = (self._rotation + 1) % n
            rest = self._addresses[self._rotation :] + self._addresses[: self._rotation]
            leader = self.leader
        if leader in rest:
            rest.remove(leader)
            rest.insert(0, leader)
        if not self._failed_at:  # nothing failed lately (the common case)
            return rest
        healthy = [a for a in rest if not self._failed_lately(a, now)]
        return healthy or rest

    def not_leader(self, address: str, error: NotLeaderError) -> bool:
        """``address`` said it is not the leader; True when it named another one (start over
        with it first). A master named that failed us lately is not followed: the one who
        names it has not heard of the election yet."""
        if error.leader and error.leader != address:
            if self._failed_lately(error.leader, self._clock()):
                return False
            with self._lock:
                if error.leader not in self._addresses:
                    self._addresses.append(error.leader)
            self.leader = error.leader
            return True
        if self.leader == address:
            self.leader = None
        return False

    def failed(self, address: str, *, slow: bool = False) -> None:
        """A call to ``address`` failed; ``slow``: it took the whole attempt (a paused or cut-off
        master), so it is not asked again for ``FAILED_HOLD_S`` while another master can be. A
        master that answered (no lease yet, not caught up) or refused the connection at once
        costs nothing to ask again."""
        if slow:
            self._failed_at[address] = self._clock()
        if self.leader == address:
            self.leader = None

    def succeeded(self, address: str, leader_only: bool) -> None:
        self._failed_at.pop(address, None)
        if leader_only:
            self.leader = address


# The steps and I/O requests below are not frozen: some are built on every call to a master, and
# a frozen dataclass takes about twice as long to build. Nothing changes them once built.


@dataclass(slots=True)
class Ask:
    """Call the master at ``address``; the attempt may take ``timeout_s``."""

    address: str
    timeout_s: float


@dataclass(slots=True)
class Wait:
    """Sleep ``delay_s``, then start a :meth:`CallPlan.new_round`."""

    delay_s: float


@dataclass(slots=True)
class GiveUp:
    """Raise ``error``: it cannot be retried, or the deadline passed."""

    error: KVPoolError


Step = Ask | Wait | GiveUp


class CallPlan:
    """The retry policy of one call to the master group, without I/O: which master to ask next
    and for how long, when to follow a redirect, back off or give up. :class:`MasterCall`
    performs each :class:`Step` and reports how it went; ``now`` is its clock (``deadline``'s).

    Masters are asked in rounds, in :meth:`MasterRouting.order`. A NOT_LEADER naming another
    master ends the round (the next starts with that leader) and skips the backoff, except on
    every 4th redirect of the call (masters may disagree during an election); any other
    retryable error moves on to the next master. A round that found no answer backs off
    (exponential, jittered, never past the deadline); once the deadline passes:
    DeadlineExceededError with the last error; a non-retryable error (refused credentials, a
    bad request): given up at once."""

    def __init__(
        self,
        routing: MasterRouting,
        method: str,
        *,
        deadline: float,
        attempt_timeout_s: float,
        leader_only: bool = False,
        backoff: Backoff | None = None,
    ) -> None:
        self.routing = routing
        self.method = method
        self.deadline = deadline
        self.attempt_timeout_s = attempt_timeout_s
        self.names_leader = leader_only or method in LEADER_READS
        self._backoff = backoff
        self.last: KVPoolError | None = None
        self.redirects = 0
        self._round: list[str] = []
        self._next = 0
        self._asked = ""
        self._redirected = False

    def new_round(self, now: float) -> Step:
        """Ask the masters again, in the routing's order: the call's first step, and the next
        one after a :class:`Wait`."""
        self._round = self.routing.order()
        self._next = 0
        self._redirected = False
        return self._ask(now)

    def answered(self) -> None:
        """The last :class:`Ask` succeeded (the call is done)."""
        self.routing.succeeded(self._asked, self.names_leader)

    def failed(self, error: KVPoolError, now: float) -> Step:
        """The last :class:`Ask` raised ``error``: the next step."""
        address = self._asked
        if isinstance(error, NotLeaderError):
            self.last = error
            if self.routing.not_leader(address, error):
                self._redirected = True
                self.redirects += 1
                self._next = len(self._round)  # start over with the leader first
        elif isinstance(error, UnavailableError | DeadlineExceededError | NotCaughtUpError):
            self.last = error
            self.routing.failed(address, slow=isinstance(error, DeadlineExceededError))
        elif not error.retryable:
            return GiveUp(error)
        else:
            self.last = error
        return self._ask(now)

    def _ask(self, now: float) -> Step:
        remaining = self.deadline - now
        if self._next < len(self._round) and remaining > 0:
            self._asked = self._round[self._next]
            self._next += 1
            return Ask(self._asked, min(remaining, self.attempt_timeout_s))
        if remaining <= 0:
            return GiveUp(
                DeadlineExceededError(
                    f"Master.{self.method}: no master answered in time"
                    + (f" (last error: {self.last.message})" if self.last else "")
                )
            )
        if self._redirected and self.redirects % 4 != 0:
            return self.new_round(now)
        if self._backoff is None:  # made only for a call that has to wait (most never do)
            self._backoff = Backoff()
        return Wait(min(self._backoff.next_delay(), remaining))


@dataclass(slots=True)
class CallGrpc:
    """Call ``Master.<method>`` on the master at ``address`` over gRPC; answer its response."""

    address: str
    method: str
    request: Any
    timeout_s: float


@dataclass(slots=True)
class CallRpcPort:
    """Exchange ``call`` (traced) on a connection to the frame RPC port ``rpc``, opened (and its
    features asked when tracing) if none is; one that fails is dropped. The answer: in ``call``."""

    rpc: str
    call: Call
    timeout_s: float


Io = Wait | CallGrpc | CallRpcPort  # what a MasterCall asks its driver to do (Wait: sleep)


class MasterCall:
    """One call to the master group without I/O (``clock``: the one the plan's deadline is in):
    :class:`CallPlan`'s attempts, each made and read by :func:`_attempt`. A driver
    (:meth:`MasterClient.call`, :meth:`SyncMasterClient.call`) performs each :class:`Io` that
    :meth:`next` names and passes its result, or the KVPoolError it raised, to the next ``next``;
    that answers None once the call succeeded (:attr:`response`), and raises when it failed."""

    def __init__(self, plan: CallPlan, request: Any, clock: Callable[[], float]) -> None:
        self.response: Any = None
        self._flow = _call(plan, request, clock)

    def next(self, result: Any = None) -> Io | None:
        try:
            if isinstance(result, KVPoolError):
                return self._flow.throw(result)
            return self._flow.send(result)
        except StopIteration as stop:
            self.response = stop.value
            return None


Flow = Generator[Io, Any, Any]  # each Io yielded is answered (sent) or its error thrown in


def _call(plan: CallPlan, request: Any, clock: Callable[[], float]) -> Flow:
    step = plan.new_round(clock())
    while not isinstance(step, GiveUp):
        if isinstance(step, Wait):
            yield step
            step = plan.new_round(clock())
            continue
        try:
            response = yield from _attempt(plan, step, request, clock)
        except KVPoolError as e:
            step = plan.failed(e, clock())
        else:
            plan.answered()
            return response
    raise step.error


def _attempt(plan: CallPlan, ask: Ask, request: Any, clock: Callable[[], float]) -> Flow:
    """One call to one master: over its frame RPC port (``rpc_address`` in its GetMembers answer)
    when it has one and serves the call there (:data:`RPC_RESPONSES`: the same messages and typed
    errors, without gRPC's per-call cost), else over gRPC. A port not known yet is learned by a
    gRPC GetMembers first, kept when it is what was asked; its time comes off the attempt's."""
    routing, method, address, timeout_s = plan.routing, plan.method, ask.address, ask.timeout_s
    rpc = routing.rpc_of(address) if method in RPC_RESPONSES else ""
    if rpc is None:
        started = clock()
        learn = CallGrpc(address, "GetMembers", master_pb2.GetMembersRequest(), timeout_s)
        try:
            members = yield learn
        except KVPoolError as e:
            rpc = no_rpc_port(routing, address, e)
        else:
            rpc = rpc_port_address(str(members.rpc_address))
            read = rpc_port_address(str(members.read_address)) if rpc else ""
            routing.learn_rpc(address, rpc, read)
            if method == "GetMembers":
                return members
        timeout_s -= clock() - started
    if not rpc:
        return (yield CallGrpc(address, method, request, timeout_s))
    # Index reads go to the read port when the master offers one (unless traced: its threads
    # make no spans), the rest to the RPC port.
    if method in READ_METHODS and not tracing.STATE.enabled:
        rpc = routing.read_of(address) or rpc
    payload = request.SerializeToString()  # the time allowed, in µs, goes as the version
    call = Call(Op.RPC, method.encode(), version=max(1, int(timeout_s * 1e6)), payload=payload)
    try:
        yield CallRpcPort(rpc, call, timeout_s)
    except KVPoolError as e:
        raise rpc_failure(address, rpc, method, e, routing) from None
    return rpc_answer(address, method, call, routing)


ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)


class _MasterCaller(Generic[ChannelT]):
    """What both drivers share: routing, attempt bound, credentials, a stub per master."""

    def __init__(
        self,
        routing: MasterRouting,
        attempt_timeout_s: float,
        security: Security,
        new_channel: Callable[[str, Security], ChannelT],
    ) -> None:
        self.routing = routing
        self.security = security
        self._attempt_timeout_s = attempt_timeout_s
        self._metadata = call_metadata(security)
        self._new_channel = new_channel
        self._channels: dict[str, ChannelT] = {}
        self._stubs: dict[str, master_pb2_grpc.MasterStub] = {}
        self._lock = threading.Lock()
        self._closed = False  # only a SyncMasterClient closes for good

    def stub(self, address: str) -> master_pb2_grpc.MasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            with self._lock:
                if self._closed:
                    raise UnavailableError("this kvpool client is closed")
                stub = self._stubs.get(address)
                if stub is None:
                    channel = self._new_channel(address, self.security)
                    self._channels[address] = channel
                    stub = master_pb2_grpc.MasterStub(channel)
                    self._stubs[address] = stub
        return stub

    def _plan(self, method: str, deadline: float, leader_only: bool) -> CallPlan:
        return CallPlan(
            self.routing,
            method,
            deadline=deadline,
            attempt_timeout_s=self._attempt_timeout_s,
            leader_only=leader_only,
        )

    def _grpc(self, io: CallGrpc, unary: Callable[..., Any]) -> Any:
        """``io`` by ``unary`` (:func:`~kvpool.grpcutil.unary` or ``unary_sync``)."""
        return unary(
            getattr(self.stub(io.address), io.method),
            io.request,
            timeout_s=io.timeout_s,
            address=io.address,
            metadata=self._metadata,
        )


class MasterClient(_MasterCaller[grpc.aio.Channel]):
    """Stubs for every master, a preferred (leader) address, and a retrying ``call``."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        attempt_timeout_s: float = 1.0,
        routing: MasterRouting | None = None,
        security: Security = NO_SECURITY,
    ) -> None:
        routing = routing or MasterRouting(addresses)
        super().__init__(routing, attempt_timeout_s, security, create_channel)
        # One pipelined connection per master's frame RPC port (see _attempt).
        self._rpc_pool = ConnectionPool(
            size=1, connect_timeout_s=attempt_timeout_s, opener=self._open_rpc
        )

    @property
    def addresses(self) -> list[str]:
        return self.routing.addresses

    @property
    def leader(self) -> str | None:
        return self.routing.leader

    @leader.setter
    def leader(self, address: str | None) -> None:
        self.routing.leader = address

    async def _open_rpc(self, address: str, timeout_s: float) -> FrameConnection:
        deadline = time.monotonic() + timeout_s
        conn = await open_tcp_address(address, timeout_s, self.security.token)
        if tracing.STATE.enabled:
            conn.features = await _rpc_features_async(conn, time_left(deadline))
        return conn

    async def _perform(self, io: Io) -> Any:
        if isinstance(io, Wait):
            await asyncio.sleep(io.delay_s)
        elif isinstance(io, CallGrpc):
            return await self._grpc(io, unary)
        else:
            target = f"tcp://{io.rpc}"
            deadline = time.monotonic() + io.timeout_s  # for connecting and the exchange
            try:
                conn = await self._rpc_pool.get(target, timeout_s=io.timeout_s)
                await conn.exchange([io.call], time_left(deadline), trace=tracing.frame_trace())
            except KVPoolError:
                self._rpc_pool.discard(target)
                raise
        return None

    async def call(
        self,
        method: str,
        request: Any,
        *,
        deadline: float,
        leader_only: bool = False,
    ) -> Any:
        """Call ``Master.<method>`` until it succeeds, a non-retryable error is raised, or the
        deadline (``asyncio`` loop time) passes (DeadlineExceededError, with the last error);
        the policy is :class:`CallPlan`'s, each attempt :class:`MasterCall`'s."""
        loop = asyncio.get_running_loop()
        call = MasterCall(self._plan(method, deadline, leader_only), request, loop.time)
        result: Any = None
        while (io := call.next(result)) is not None:
            try:
                result = await self._perform(io)
            except KVPoolError as e:
                result = e
        return call.response

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        await self._rpc_pool.close()
        for channel in channels.values():
            await channel.close()


class SyncMasterClient(_MasterCaller[grpc.Channel]):
    """As :class:`MasterClient`, in the calling thread (thread-safe; sync gRPC, and a blocking
    connection per thread to each RPC port). ``deadline`` is ``time.monotonic()`` based.
    ``busy_poll_s``: spin that long for the answer to a read (:data:`READ_METHODS`) on the RPC
    port before sleeping (see ``ClientConfig.busy_poll_us``)."""

    def __init__(
        self,
        routing: MasterRouting,
        *,
        attempt_timeout_s: float = 1.0,
        security: Security = NO_SECURITY,
        busy_poll_s: float = 0.0,
    ) -> None:
        super().__init__(routing, attempt_timeout_s, security, create_sync_channel)
        self._rpc_conns = ThreadConnections(max_idle=2)  # RPC address -> connection
        self.busy_poll_s = busy_poll_s

    def _perform(self, io: Io, poll_s: float = 0.0) -> Any:
        if isinstance(io, Wait):
            time.sleep(io.delay_s)
        elif isinstance(io, CallGrpc):
            return self._grpc(io, unary_sync)
        else:
            deadline = time.monotonic() + io.timeout_s
            conn = self._rpc_conns.get(io.rpc)
            if conn is None:
                conn = self._open_rpc(io.rpc, io.timeout_s, deadline)
                self._rpc_conns.add(io.rpc, conn)
            try:
                conn.exchange([io.call], deadline, trace=tracing.frame_trace(), poll_s=poll_s)
            except KVPoolError:
                self._rpc_conns.discard(io.rpc, conn)
                raise
        return None

    def _open_rpc(self, rpc: str, timeout_s: float, deadline: float) -> BlockingConnection:
        host, _, port = rpc.rpartition(":")
        sock = connect_tcp_blocking(host.strip("[]"), int(port), address=rpc, timeout_s=timeout_s)
        try:
            authenticate_blocking(sock, self.security.token, f"tcp://{rpc}", time_left(deadline))
        except KVPoolError:
            sock.close()
            raise
        conn = BlockingConnection(sock, f"tcp://{rpc}", timeout_s=time_left(deadline))
        if tracing.STATE.enabled:
            conn.features = _rpc_features(conn, deadline)
        return conn

    def lend_this_threads(self) -> None:
        """This thread's RPC connections go to the next thread that needs one (a warm-up's)."""
        self._rpc_conns.lend_this_threads()

    def call(self, method: str, request: Any, *, deadline: float, leader_only: bool = False) -> Any:
        """As :meth:`MasterClient.call`, in this thread (``deadline``: ``time.monotonic()``)."""
        call = MasterCall(self._plan(method, deadline, leader_only), request, time.monotonic)
        poll_s = self.busy_poll_s if method in READ_METHODS else 0.0
        result: Any = None
        while (io := call.next(result)) is not None:
            try:
                result = self._perform(io, poll_s)
            except KVPoolError as e:
                result = e
        return call.response

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            channel.close()
        self._rpc_conns.close()


READ_METHODS = frozenset({"Lookup", "PrefixMatch", "GetMembers"})
"""The calls answered from the index as it is (no Raft round): a master answers them without a
coroutine when it can (``MasterService.read_now``) and on its read port too (``read_address``;
raft_master/read_port.py); worth a busy poll."""

RPC_RESPONSES: dict[str, type[Any]] = {
    "Lookup": master_pb2.LookupResponse,
    "CommitPuts": master_pb2.CommitPutsResponse,
    "GetMembers": master_pb2.GetMembersResponse,
    "PrefixMatch": master_pb2.PrefixMatchResponse,
    "Remove": master_pb2.RemoveResponse,
}
"""The calls masters serve on their frame RPC port, and the type of each answer."""


def _rpc_features(conn: BlockingConnection, deadline: float) -> frozenset[str]:
    """What a master's RPC port offers (asked only when tracing: ``trace``); nothing when it
    does not answer HELLO (an older master answers BAD_REQUEST)."""
    call = Call(Op.HELLO)
    try:
        conn.exchange([call], deadline)
    except KVPoolError:
        return frozenset()
    return _hello_features(call)


def _hello_features(call: Call) -> frozenset[str]:
    """The ``features`` of a HELLO answer (none when it is not one)."""
    if call.status != Status.OK or call.data is None:
        return frozenset()
    try:
        return frozenset(str(f) for f in json.loads(bytes(call.data)).get("features", ()))
    except (ValueError, TypeError, AttributeError):
        return frozenset()


def rpc_port_address(text: str) -> str:
    """A master's advertised ``host:port`` frame RPC address, or "" (no port: call it over
    gRPC) when the text is not one — a master's answer is checked like any peer's."""
    host, _, port = text.rpartition(":")
    if not host or len(text) > 300 or not port.isdigit() or not 0 < int(port) < 65536:
        return ""
    return text


def no_rpc_port(routing: MasterRouting, address: str, error: KVPoolError) -> str:
    """Learning a master's RPC port (its GetMembers) failed with ``error``: re-raised when the
    master is down, slow, refusing us or not caught up (the caller moves on to another master);
    otherwise the master cannot say (an older or partial implementation): gRPC for every call
    to it from now on — returns ""."""
    if isinstance(
        error,
        UnavailableError
        | DeadlineExceededError
        | NotLeaderError
        | NotCaughtUpError
        | UnauthenticatedError,
    ):
        raise error
    routing.learn_rpc(address, "")
    return ""


def rpc_failure(
    address: str, rpc: str, method: str, error: KVPoolError, routing: MasterRouting
) -> KVPoolError:
    """The typed error for an RPC frame that got no answer (the connection is gone). A port
    that refused or dropped the connection is forgotten: a restarted master has a new one."""
    if isinstance(error, UnauthenticatedError):
        return error
    if isinstance(error, DeadlineExceededError):
        return DeadlineExceededError(f"{address}: {method} timed out")
    routing.forget_rpc(address, rpc)
    return UnavailableError(f"{address}: {method} over its RPC port {rpc}: {error.message}")


async def _rpc_features_async(conn: FrameConnection, timeout_s: float) -> frozenset[str]:
    """:func:`_rpc_features` on an event loop."""
    call = Call(Op.HELLO)
    try:
        await conn.exchange([call], timeout_s)
    except KVPoolError:
        return frozenset()
    return _hello_features(call)


def rpc_answer(address: str, method: str, call: Call, routing: MasterRouting) -> Any:
    """The response of an answered RPC frame, or the typed error it carries."""
    data = owned_bytes(call.data) if call.data is not None else b""
    if call.error is not None:
        raise UnavailableError(f"{address}: {method}: {call.error}")
    if call.status == Status.OK:
        try:
            return RPC_RESPONSES[method].FromString(data)
        except DecodeError as e:  # garbled on the way, or not a master: ask another one
            raise UnavailableError(
                f"{address}: {method}: an answer that does not decode ({e})"
            ) from None
    if call.status == Status.RPC_ERROR:
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        raise error_from_code(
            doc.get("code"),
            f"{address}: {doc.get('message', 'no message')}",
            leader=doc.get("leader"),
        )
    # A port that does not know the call (another release): gRPC from now on.
    routing.learn_rpc(address, "")
    raise UnavailableError(f"{address}: {method} over its RPC port: status {call.status}")
