"""Both group committers around a fake CommitPuts: what they send, what they count, and what a
failed request does to the puts riding in it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpool.client.commits import AsyncCommitter, SyncCommitter
from kvpool.errors import DeadlineExceededError, UnavailableError
from kvpool.proto.v1 import master_pb2


def _answer(request: master_pb2.CommitPutsRequest) -> master_pb2.CommitPutsResponse:
    return master_pb2.CommitPutsResponse(
        results=[master_pb2.PutResult() for _ in request.entries], revision=7
    )


def _entries(n: int) -> list[master_pb2.PutEntry]:
    return [master_pb2.PutEntry(key=f"k{i}") for i in range(n)]


def test_a_job_of_half_a_request_goes_alone_under_its_own_deadline() -> None:
    sent: list[tuple[int, float]] = []

    def call(
        request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        sent.append((len(request.entries), deadline))
        return _answer(request)

    committer = SyncCommitter(call, lambda: 4)
    deadline = time.monotonic() + 5
    answer = committer.commit(1, _entries(2), deadline)
    assert len(answer.results) == 2
    assert answer.revision == 7
    assert sent == [(2, deadline)]


@pytest.mark.parametrize("entries", [1, 3])  # grouped, and alone
def test_a_failed_request_fails_each_put_in_it_with_its_error(entries: int) -> None:
    error = UnavailableError("no master")

    def call(
        request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        raise error

    committer = SyncCommitter(call, lambda: 4)
    with pytest.raises(UnavailableError) as failed:
        committer.commit(1, _entries(entries), time.monotonic() + 5)
    assert failed.value is error


def test_puts_that_wait_on_the_event_loop_ride_together_and_are_counted() -> None:
    sent: list[int] = []

    async def call(
        request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        sent.append(len(request.entries))
        await asyncio.sleep(0.01)
        return _answer(request)

    async def main() -> AsyncCommitter:
        committer = AsyncCommitter(call, lambda: 100)
        deadline = asyncio.get_running_loop().time() + 5
        answers = await asyncio.gather(
            *(committer.commit(1, _entries(1), deadline) for _ in range(10))
        )
        assert all(len(a.results) == 1 for a in answers)
        return committer

    committer = asyncio.run(main())
    assert sum(sent) == 10
    assert committer.jobs == 10
    assert committer.requests == len(sent) < 10


def test_a_thread_sending_for_others_returns_by_its_own_deadline() -> None:
    """A put that leads a request carrying a later-deadline put is not held past its own
    deadline when the master does not answer (the chaos suite saw a 1 s put take 2 s)."""
    first_sent = threading.Event()
    release_first = threading.Event()
    deadlines: list[float] = []

    def call(
        request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        deadlines.append(deadline)
        if len(deadlines) == 1:
            first_sent.set()
            release_first.wait(5)
            return _answer(request)
        time.sleep(max(0.0, deadline - time.monotonic()))  # a master that never answers
        raise DeadlineExceededError("CommitPuts: no answer before the deadline")

    committer = SyncCommitter(call, lambda: 100)
    finished: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def put(name: str, timeout_s: float) -> None:
        try:
            committer.commit(1, _entries(1), time.monotonic() + timeout_s)
        except BaseException as e:
            errors[name] = e
        finished[name] = time.monotonic()

    first = threading.Thread(target=put, args=("first", 5.0))
    first.start()
    assert first_sent.wait(5)
    start = time.monotonic()
    short = threading.Thread(target=put, args=("short", 0.5))  # queued first: it will send
    short.start()
    time.sleep(0.05)
    long = threading.Thread(target=put, args=("long", 3.0))  # rides along
    long.start()
    time.sleep(0.05)
    release_first.set()
    for t in (first, short, long):
        t.join(10)
    assert "first" not in errors
    assert isinstance(errors["short"], DeadlineExceededError)
    assert finished["short"] - start < 0.5 + 0.3
    assert deadlines[1] <= start + 0.5 + 0.01  # sent under the sender's deadline
