"""The two-process cells of ``kvpool-bench peers`` that run in a bench worker: ``hand-off`` and
``engine``. Each involves both workers, one writer (``role`` "write") and one reader ("read"),
with ``partner`` the other's index; the message is the orchestrator's cell message.

*hand-off* — the P/D-disaggregated hand-off, one block at a time: the writer puts a block
(one key per call) and, the moment the put returns True, sends the key over a pipe shared by
the two workers only (:attr:`Worker.link`); the reader, blocked on that pipe, reads the block
once (``get_into`` or the system's single-key get) and answers "done"; only then does the
writer put the next block, so no hand-off queues behind another. Both processes time with
``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux: one clock for every process of the host),
so the writer's put start and the reader's read end make the *hand-off latency*; the reader
also reports the read alone and the *signal* (put returned -> key received). Before its blocks
each cell times pipe round trips without a store call (:data:`PINGS`): half of one is what the
signalling itself costs. A read that finds nothing although the put returned True is a
*hand-off miss*.

*engine* — how an engine calls a store (:mod:`kvpool_bench.flows`): the writer puts a pass of
batches (untimed, one batched put per batch), of each batch all keys but the last quarter
(:func:`written_per_batch`), so that the query has misses to report; once every put has
returned, the reader — whose client has never seen these keys, as a fresh engine — runs each
batch's query (timed) and reads the hits into its destination arena (timed), then checks every
byte. Each flow of the system (kvpool: ``prefix_match`` and ``batch_exists``) reads keys of
its own, so the second starts with a cold lookup cache too.

Every block read is compared with the writer's bytes, as in a first read
(:mod:`kvpool_bench.worker`): the reader draws the writer's arena from its seed and stamps it
the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvpool_bench.drivers import Array, PassResult, Result
from kvpool_bench.flows import EngineFlow, engine_flows
from kvpool_bench.worker import (
    BARRIER_TIMEOUT_S,
    POISON,
    _new_get,
    _new_put,
    bench_keys,
    slots,
    stamped,
    verify,
)

if TYPE_CHECKING:
    from kvpool_bench.worker import Worker

PINGS = 32
"""Pipe round trips timed at the start of every hand-off cell."""
LINK_TIMEOUT_S = 120.0


def written_per_batch(batch: int) -> int:
    """Keys of an engine batch the writer puts: all but the last quarter (all of a batch of
    fewer than 4 keys)."""
    return batch - batch // 4


def _receive(link: Connection, uid: int) -> tuple[Any, ...]:
    """The partner's next message of this cell (a message of an earlier, failed cell is
    dropped); an error when none comes in time (the partner failed)."""
    while True:
        if not link.poll(LINK_TIMEOUT_S):
            raise RuntimeError(f"the partner worker sent nothing for {LINK_TIMEOUT_S:.0f}s")
        msg: tuple[Any, ...] = link.recv()
        if msg[0] == uid:
            return msg


def _pipe_one_way_us(link: Connection, role: str, uid: int) -> list[float]:
    """Half of each of PINGS pipe round trips (the writer's clock), in µs; the reader echoes."""
    out = []
    for i in range(PINGS):
        if role == "write":
            t = time.perf_counter()
            link.send((uid, "ping", i))
            _receive(link, uid)
            out.append(round((time.perf_counter() - t) / 2 * 1e6, 2))
        else:
            _receive(link, uid)
            link.send((uid, "pong", i))
    return out


def hand_off(worker: Worker, msg: dict[str, Any]) -> dict[str, Any]:
    drv = worker.drivers[msg["system"]]
    link = worker.link
    if link is None:
        raise RuntimeError("a hand-off needs the link between the two workers")
    size, n, uid = int(msg["size_bytes"]), int(msg["keys_per_pass"]), int(msg["uid"])
    role, partner = msg["role"], int(msg["partner"])
    writer = worker.index if role == "write" else partner
    if n * size > worker.src.nbytes:
        raise ValueError("a pass does not fit the arena")
    srcs = slots(worker.src, size, n)
    dsts = slots(worker.dst, size, n)
    expected = slots(worker.arena_of(writer), size, n)
    put, get = _new_put(), _new_get()
    hand: dict[str, Any] = {"latency_us": [], "signal_us": [], "unacknowledged": 0}
    worker.barrier.wait(BARRIER_TIMEOUT_S)
    hand["pipe_one_way_us"] = _pipe_one_way_us(link, role, uid)
    for p in range(int(msg["passes"])):
        keys = bench_keys(msg["run"], uid, writer, p, n)
        if role == "read":
            worker.dst[: n * size].fill(POISON)
        worker.barrier.wait(BARRIER_TIMEOUT_S)
        if role == "write":
            with stamped(srcs, uid, p, writer):
                for key, src in zip(keys, srcs, strict=True):
                    pr = drv.put_pass([key], [src], 0)
                    link.send((uid, key, pr.ok[0], pr.start, pr.end))
                    put["durations_us"].append(round((pr.end - pr.start) * 1e6, 2))
                    put["failures"] += not pr.ok[0]
                    put["errors"].extend(e for e in pr.errors if e not in put["errors"])
                    _receive(link, uid)  # the reader is done with this block
            drv.remove(keys)
            continue
        got: list[Result] = []
        acked: list[int] = []
        for j in range(n):
            _, key, ok, put_start, put_end = _receive(link, uid)
            received = time.perf_counter()
            if key != keys[j]:
                raise RuntimeError(f"hand-off: expected key {keys[j]!r}, the writer sent {key!r}")
            if ok:
                gr = drv.get_pass([key], [dsts[j]], 0)
                got.append(gr.got[0])
                acked.append(j)
                hand["latency_us"].append(round((gr.end - put_start) * 1e6, 2))
                hand["signal_us"].append(round((received - put_end) * 1e6, 2))
                get["durations_us"].append(round((gr.end - gr.start) * 1e6, 2))
                get["errors"].extend(e for e in gr.errors if e not in get["errors"])
            else:
                hand["unacknowledged"] += 1
            link.send((uid, "done"))
        with stamped(expected, uid, p, writer):
            verify(got, [expected[j] for j in acked], size, get)
    if role == "write":
        return {"put": put, "handoff": hand}
    del get["errors"][5:]
    return {"get": get, "handoff": hand}


def _flow_keys(msg: dict[str, Any], writer: int, unit: int, count: int) -> list[str]:
    return bench_keys(msg["run"], msg["uid"], writer, unit, count)


def engine(worker: Worker, msg: dict[str, Any]) -> dict[str, Any]:
    drv = worker.drivers[msg["system"]]
    size, batch, uid = int(msg["size_bytes"]), int(msg["batch"]), int(msg["uid"])
    n = int(msg["keys_per_pass"])
    role, partner = msg["role"], int(msg["partner"])
    writer = worker.index if role == "write" else partner
    queries: Sequence[str] = msg["queries"]
    if n * size > worker.src.nbytes or n % batch:
        raise ValueError("a pass does not fit the arena, or is not whole batches")
    written = written_per_batch(batch)
    present = [j % batch < written for j in range(n)]
    srcs = slots(worker.src, size, n)
    dsts = slots(worker.dst, size, n)
    expected = slots(worker.arena_of(writer), size, n)
    flows = engine_flows(drv) if role == "read" else {}
    missing = [q for q in queries if role == "read" and q not in flows]
    if missing:
        raise RuntimeError(f"{msg['system']}: no engine flow {', '.join(missing)}")
    out: dict[str, dict[str, Any]] = {q: _new_flow(flows[q].label if flows else q) for q in queries}
    unit = 0
    for _p in range(int(msg["passes"])):
        for q in queries:
            keys = _flow_keys(msg, writer, unit, n)
            worker.barrier.wait(BARRIER_TIMEOUT_S)
            if role == "write":
                ks = [k for k, x in zip(keys, present, strict=True) if x]
                ss = [s for s, x in zip(srcs, present, strict=True) if x]
                with stamped(srcs, uid, unit, writer):
                    pr = drv.put_pass(ks, ss, written)
                out[q]["put_failures"] += len(pr.ok) - sum(pr.ok)
            else:
                worker.dst[: n * size].fill(POISON)
            worker.barrier.wait(BARRIER_TIMEOUT_S)  # every put has returned
            if role == "read":
                _read_batches(
                    flows[q],
                    keys=keys,
                    dsts=dsts,
                    expected=expected,
                    present=present,
                    batch=batch,
                    out=out[q],
                    unit=unit,
                    msg=msg,
                )
            worker.barrier.wait(BARRIER_TIMEOUT_S)  # every read is done
            if role == "write":
                drv.remove(keys)
            unit += 1
    return {"engine": out}


def _new_flow(label: str) -> dict[str, Any]:
    return {
        "label": label,
        "batches": 0,
        "query_us": [],
        "flow_us": [],
        "keys_asked": 0,
        "hits": 0,
        "misses": 0,
        "phantoms": 0,
        "put_failures": 0,
        "index_calls": None,
        "read_misses": 0,
        "wrong": 0,
        "bytes_read": 0,
        "bytes_verified": 0,
        "errors": [],
    }


def _read_batches(
    flow: EngineFlow,
    *,
    keys: list[str],
    dsts: list[Array],
    expected: list[Array],
    present: list[bool],
    batch: int,
    out: dict[str, Any],
    unit: int,
    msg: dict[str, Any],
) -> None:
    """One pass of the engine flow: query then read each batch (timed), then check."""
    clock = time.perf_counter
    before = flow.index_calls()
    reads: list[tuple[int, Result]] = []
    for b in range(0, len(keys), batch):
        ks = keys[b : b + batch]
        t = clock()
        found = flow.query(ks)
        asked = clock()
        hit = [b + i for i, x in enumerate(found) if x]
        res = PassResult()
        got = flow.read([keys[i] for i in hit], [dsts[i] for i in hit], res) if hit else []
        done = clock()
        out["query_us"].append(round((asked - t) * 1e6, 2))
        out["flow_us"].append(round((done - t) * 1e6, 2))
        out["batches"] += 1
        out["keys_asked"] += len(ks)
        out["hits"] += len(hit)
        reads.extend(zip(hit, got, strict=True))
        out["errors"].extend(e for e in res.errors if e not in out["errors"])
        for i, x in enumerate(found):
            out["misses"] += present[b + i] and not x
            out["phantoms"] += x and not present[b + i]
    after = flow.index_calls()
    if before is not None and after is not None:
        calls = out["index_calls"] or {}
        for method, count in after.items():
            if count > before.get(method, 0):
                calls[method] = calls.get(method, 0) + count - before.get(method, 0)
        out["index_calls"] = calls
    checked = [(i, r) for i, r in reads if present[i]]
    got_blocks = [r for _, r in checked]
    with stamped(expected, int(msg["uid"]), unit, int(msg["partner"])):
        counts = {"misses": 0, "wrong": 0, "bytes_read": 0, "bytes_verified": 0}
        verify(got_blocks, [expected[i] for i, _ in checked], int(msg["size_bytes"]), counts)
    out["read_misses"] += counts["misses"]
    for k in ("wrong", "bytes_read", "bytes_verified"):
        out[k] += counts[k]
    del out["errors"][5:]
