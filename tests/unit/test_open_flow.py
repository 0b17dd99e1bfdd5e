"""How a client connection to a node is made (:func:`kvpool.client.links.open_flow`), given the
answers a shell would feed it: which connections it opens, which one it keeps, with which
features, what it remembers, and which it closes."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

from kvpool.client.links import Dial, Links, NodeOffer, open_flow
from kvpool.client.ops import drive
from kvpool.errors import DeadlineExceededError, KVPoolError, TransportError

NODE = "tcp://10.0.0.7:7400"
SHM = "shm://kvp-node-7"
SHM_OFFER = NodeOffer(mget=True, trace=True, shm_address=SHM, why_not_shm="")


class FakeConn:
    def __init__(self, address: str) -> None:
        self.address = address
        self.features: frozenset[str] = frozenset()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def run(
    links: Links, address: str, answer: Callable[[Dial], object]
) -> tuple[FakeConn, list[Dial], list[FakeConn]]:
    """Drive the flow as a shell does: the connection it returns, the dials, what was opened."""
    dials: list[Dial] = []
    opened: list[FakeConn] = []

    def dial(step: Dial) -> object:
        dials.append(step)
        got = answer(step)
        if isinstance(got, FakeConn):
            opened.append(got)
        elif isinstance(got, tuple):
            opened.append(got[0])
        return got

    flow: Generator[Dial, Any, FakeConn] = open_flow(links, address)
    return drive(flow, dial), dials, opened


def node(offer: NodeOffer, shm: Callable[[], object] | None = None) -> Callable[[Dial], object]:
    """A node answering HELLO with ``offer``; its shared memory opens, or gives ``shm()``."""

    def answer(step: Dial) -> object:
        if step.address.startswith("shm://") and shm is not None:
            return shm()
        conn = FakeConn(step.address)
        return (conn, offer) if step.hello else conn

    return answer


def test_an_address_of_another_scheme_is_opened_as_it_is() -> None:
    conn, dials, _ = run(Links("auto"), SHM, node(NodeOffer()))
    assert dials == [Dial(SHM)]
    assert conn.address == SHM
    assert conn.features == frozenset()


def test_a_first_connection_asks_hello_and_is_kept_for_tcp() -> None:
    links = Links("auto")
    offer = NodeOffer(mget=True, trace=True)
    conn, dials, _ = run(links, NODE, node(offer))
    assert dials == [Dial(NODE, hello=True)]
    assert conn.features == {"mget", "trace"}
    assert not conn.closed
    assert links.offer(NODE) == offer


def test_a_remembered_offer_skips_hello() -> None:
    links = Links("auto")
    links.learn(NODE, NodeOffer(mget=True))
    conn, dials, _ = run(links, NODE, node(NodeOffer()))
    assert dials == [Dial(NODE)]
    assert conn.features == {"mget"}


def test_shared_memory_on_offer_is_used_and_the_tcp_connection_closed() -> None:
    conn, dials, opened = run(Links("auto"), NODE, node(SHM_OFFER))
    assert dials == [Dial(NODE, hello=True), Dial(SHM)]
    assert conn.address == SHM
    assert conn.features == {"mget", "shm", "trace"}
    assert opened[0].closed
    assert not conn.closed


def test_transport_tcp_never_opens_shared_memory() -> None:
    conn, dials, _ = run(Links("tcp"), NODE, node(SHM_OFFER))
    assert dials == [Dial(NODE, hello=True)]
    assert conn.features == {"mget", "trace"}


def test_an_inproc_node_is_asked_hello_but_never_dialled_by_shared_memory() -> None:
    conn, dials, _ = run(Links("auto"), "inproc://n", node(SHM_OFFER))
    assert dials == [Dial("inproc://n", hello=True)]
    assert conn.address == "inproc://n"


def test_unreachable_shared_memory_of_a_fresh_offer_falls_back_to_tcp_for_good() -> None:
    links = Links("auto")

    def refused() -> object:
        return TransportError(f"{SHM}: connect failed: refused")

    conn, dials, opened = run(links, NODE, node(SHM_OFFER, refused))
    assert dials == [Dial(NODE, hello=True), Dial(SHM)]
    assert conn is opened[0]
    assert not conn.closed
    assert conn.features == {"mget", "trace"}
    remembered = links.offer(NODE)
    assert remembered is not None
    assert not remembered.shm_address
    assert "shared memory unreachable" in remembered.why_not_shm


def test_unreachable_shared_memory_of_a_remembered_offer_asks_the_node_again() -> None:
    links = Links("auto")
    links.learn(NODE, SHM_OFFER)  # from before the node restarted
    fresh = NodeOffer(mget=True)

    def answer(step: Dial) -> object:
        if step.address == SHM:
            return TransportError(f"{SHM}: connect failed: no such name")
        conn = FakeConn(step.address)
        return (conn, fresh) if step.hello else conn

    conn, dials, _ = run(links, NODE, answer)
    assert dials == [Dial(SHM), Dial(NODE, hello=True)]
    assert conn.features == {"mget"}
    assert links.offer(NODE) == fresh


@pytest.mark.parametrize(
    ("transport", "error"),
    [
        ("auto", DeadlineExceededError(f"{SHM}: connect timed out")),  # slow: no second try
        ("shm", TransportError(f"{SHM}: connect failed")),  # shared memory or nothing
    ],
)
def test_a_shared_memory_failure_that_going_on_cannot_help_is_raised(
    transport: str, error: KVPoolError
) -> None:
    opened: list[FakeConn] = []

    def answer(step: Dial) -> object:
        if step.address == SHM:
            return error
        conn = FakeConn(step.address)
        opened.append(conn)
        return (conn, SHM_OFFER) if step.hello else conn

    with pytest.raises(type(error)) as failed:
        run(Links(transport), NODE, answer)
    assert failed.value is error
    assert [c.closed for c in opened] == [True]


def test_transport_shm_without_an_offer_fails_and_closes_the_tcp_connection() -> None:
    opened: list[FakeConn] = []

    def answer(step: Dial) -> object:
        conn = FakeConn(step.address)
        opened.append(conn)
        return conn, NodeOffer(why_not_shm="the node runs on another host")

    with pytest.raises(TransportError, match="another host"):
        run(Links("shm"), NODE, answer)
    assert [c.closed for c in opened] == [True]


def test_a_node_that_cannot_be_reached_ends_the_flow_with_its_error() -> None:
    error = TransportError(f"{NODE}: connect failed: refused")
    with pytest.raises(TransportError) as failed:
        run(Links("auto"), NODE, lambda step: error)
    assert failed.value is error
