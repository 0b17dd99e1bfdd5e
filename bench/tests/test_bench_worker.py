"""The bench worker checks every byte a get returns: a store that loses, garbles, misplaces or
half-writes a block is caught, and an honest one is verified in full — also in a first read,
where one worker puts and the other reads and checks the writer's bytes. In-process, with
stores that live in a dict."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvpool_bench import pair_cells
from kvpool_bench.drivers import Array, PassResult, Result, SyncDriver
from kvpool_bench.pair_cells import PINGS
from kvpool_bench.peers import first_read_parts, pair_parts
from kvpool_bench.worker import POISON, Worker, key_slot, key_writer

SIZE = 4096


class DictStore(SyncDriver):
    """A correct store: copies on put, copies into the caller's buffer on get."""

    name = "dict"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.api = {"put": "put", "get": "get"}
        self.removed = 0

    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        self.data[key] = src.tobytes()
        return True

    def read(self, key: str, dst: Array) -> Result:
        value = self.data.get(key)
        if value is None:
            return None
        dst[: len(value)] = np.frombuffer(value, np.uint8)
        return dst[: len(value)]

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        return self.read(key, dst)

    def put_many(self, keys: Sequence[str], srcs: Sequence[Array], res: PassResult) -> list[bool]:
        return [self.put_one(k, s, res) for k, s in zip(keys, srcs, strict=True)]

    def get_many(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        return [self.get_one(k, d, res) for k, d in zip(keys, dsts, strict=True)]

    def remove(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.removed += self.data.pop(k, None) is not None

    def close(self) -> None:
        pass


class FlipsAByte(DictStore):
    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        got = self.read(key, dst)
        if got is not None and key_slot(key) == 3:
            dst[100] ^= 0xFF
        return got


class LosesAKey(DictStore):
    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        return key_slot(key) == 5 or super().put_one(key, src, res)


class ServesSlotZero(DictStore):
    """Every key reads the block of slot 0 of the same pass (a misplaced read)."""

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        return self.read(key[:-16] + f"{0:016x}", dst)


class WritesHalf(DictStore):
    """Reports a whole block but writes only its first half into the caller's buffer."""

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        value = self.data[key]
        dst[: SIZE // 2] = np.frombuffer(value[: SIZE // 2], np.uint8)
        return dst[:SIZE]


class ReturnsBytes(DictStore):
    """Answers with new bytes objects (as Redis GET does)."""

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        return self.data.get(key)


def _worker(driver: DictStore) -> Worker:
    worker = Worker(0, barrier=None)
    worker.setup({"arena_bytes": 64 * SIZE, "seed": 1, "systems": []})
    worker.drivers["s"] = driver
    return worker


def _cell(worker: Worker, *, batch: int = 0, passes: int = 2, keys: int = 8) -> dict[str, Any]:
    result: dict[str, Any] = worker.cell(
        {
            "system": "s",
            "size_bytes": SIZE,
            "keys_per_pass": keys,
            "batch": batch,
            "passes": passes,
            "uid": 7,
            "run": "t",
            "together": False,
        }
    )
    return result


@pytest.mark.parametrize("batch", [0, 4])
@pytest.mark.parametrize("store", [DictStore, ReturnsBytes])
def test_an_honest_store_is_verified_in_full(batch: int, store: type[DictStore]) -> None:
    driver = store()
    out = _cell(_worker(driver), batch=batch)
    get = out["get"]
    assert get["bytes_verified"] == get["bytes_read"] == 2 * 8 * SIZE
    assert get["wrong"] == get["misses"] == out["put"]["failures"] == 0
    assert len(get["passes"]) == 2
    assert len(get["durations_us"]) == (16 if batch == 0 else 4)
    assert driver.removed == 16  # nothing left behind
    assert not driver.data


def test_values_differ_between_keys_and_passes() -> None:
    driver = DictStore()
    worker = _worker(driver)
    seen: list[bytes] = []

    def keep(keys: Sequence[str]) -> None:
        seen.extend(driver.data[k] for k in keys)
        DictStore.remove(driver, keys)

    driver.remove = keep  # type: ignore[method-assign]
    _cell(worker, passes=2, keys=4)
    assert len(set(seen)) == 8


@pytest.mark.parametrize(
    ("store", "wrong", "misses"),
    [(FlipsAByte, 2, 0), (LosesAKey, 0, 2), (ServesSlotZero, 14, 0), (WritesHalf, 16, 0)],
)
def test_a_bad_store_is_caught(store: type[DictStore], wrong: int, misses: int) -> None:
    out = _cell(_worker(store()))
    get = out["get"]
    assert get["wrong"] == wrong
    assert get["misses"] == misses
    assert get["bytes_verified"] == (16 - wrong - misses) * SIZE
    # throughput counts verified blocks only
    assert sum(p["keys"] for p in get["passes"]) == 16 - wrong - misses


def test_the_destination_is_poisoned_before_every_get_pass() -> None:
    worker = _worker(WritesHalf())
    _cell(worker, passes=1, keys=1)
    assert (worker.dst[SIZE // 2 : SIZE] == POISON).all()


# --- first read: one worker puts, the other reads (two workers in two threads) ----------------


def _pair(driver: DictStore, *, reader_seed: int = 1) -> list[Worker]:
    barrier = threading.Barrier(2)
    workers = []
    for index, seed in ((0, 1), (1, reader_seed)):
        worker = Worker(index, barrier)
        worker.setup({"arena_bytes": 64 * SIZE, "seed": seed, "systems": []})
        worker.drivers["s"] = driver
        workers.append(worker)
    return workers


def _first_read(
    workers: list[Worker], *, clients: int = 1, size: int = SIZE, keys: int = 8, uid: int = 9
) -> list[dict[str, Any]]:
    msg = {
        "cmd": "cell",
        "mode": "first-read",
        "system": "s",
        "size_bytes": size,
        "keys_per_pass": keys,
        "batch": 0,
        "passes": 2,
        "uid": uid,
        "run": "t",
    }
    parts = first_read_parts(msg, clients)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(w.cell, part) for w, part in zip(workers, parts, strict=True)]
        return [f.result(timeout=30) for f in futures]


def test_a_first_read_is_the_other_workers_and_verified_in_full() -> None:
    driver = DictStore()
    reads: list[str] = []
    get_one = driver.get_one

    def spy(key: str, dst: Array, res: PassResult) -> Result:
        reads.append(key)
        return get_one(key, dst, res)

    driver.get_one = spy  # type: ignore[method-assign]
    writer, reader = _first_read(_pair(driver))
    assert set(writer) == {"put"}
    assert set(reader) == {"get"}
    assert writer["put"]["failures"] == 0
    assert len(writer["put"]["passes"]) == 2
    get = reader["get"]
    assert get["bytes_verified"] == get["bytes_read"] == 2 * 8 * SIZE
    assert get["wrong"] == get["misses"] == 0
    assert len(get["durations_us"]) == 16  # one call per key
    assert len(reads) == len(set(reads)) == 16  # each block read exactly once ...
    assert all(key_writer(k) == 0 for k in reads)  # ... and all of them worker 0's
    assert not driver.data  # the writer removed its keys after the reads


def test_with_two_clients_each_worker_reads_the_others_keys() -> None:
    driver = DictStore()
    results = _first_read(_pair(driver), clients=2)
    for out in results:
        assert out["put"]["failures"] == 0
        assert out["get"]["bytes_verified"] == 2 * 8 * SIZE
        assert out["get"]["wrong"] == out["get"]["misses"] == 0
    assert driver.removed == 32


@pytest.mark.parametrize(
    ("store", "wrong", "misses"),
    [(FlipsAByte, 2, 0), (LosesAKey, 0, 2), (ServesSlotZero, 14, 0), (WritesHalf, 16, 0)],
)
def test_a_bad_store_is_caught_by_the_reader(
    store: type[DictStore], wrong: int, misses: int
) -> None:
    _writer, reader = _first_read(_pair(store()))
    get = reader["get"]
    assert get["wrong"] == wrong
    assert get["misses"] == misses
    assert get["bytes_verified"] == (16 - wrong - misses) * SIZE
    assert sum(p["keys"] for p in get["passes"]) == 16 - wrong - misses


def test_the_reader_compares_with_the_writers_bytes_not_its_own() -> None:
    # a reader that drew the writer's arena from another seed has the wrong copy: every
    # block read differs from it, though the store served exactly what was put
    _writer, reader = _first_read(_pair(DictStore(), reader_seed=2))
    assert reader["get"]["wrong"] == 16
    assert reader["get"]["bytes_verified"] == 0


def test_stamps_are_undone_so_earlier_cells_leave_no_trace() -> None:
    # a single-key cell at SIZE stamps the writer's arena every SIZE bytes; a later first read
    # of blocks four times as large spans those offsets, and the reader's copy never saw them
    driver = DictStore()
    workers = _pair(driver)
    assert _cell(workers[0], keys=8)["get"]["bytes_verified"] == 16 * SIZE
    _writer, reader = _first_read(workers, size=4 * SIZE, keys=4)
    assert reader["get"]["wrong"] == 0
    assert reader["get"]["bytes_verified"] == 2 * 4 * 4 * SIZE


# --- hand-off and engine: one writer, one reader, a pipe between them -------------------------


def _linked_pair(driver: DictStore) -> list[Worker]:
    barrier = threading.Barrier(2)
    ends = multiprocessing.Pipe()
    workers = []
    for index in (0, 1):
        worker = Worker(index, barrier, ends[index])
        worker.setup({"arena_bytes": 64 * SIZE, "seed": 1, "systems": []})
        worker.drivers["s"] = driver
        workers.append(worker)
    return workers


def _pair_cell(workers: list[Worker], mode: str, **extra: Any) -> list[dict[str, Any]]:
    msg = {
        "cmd": "cell",
        "mode": mode,
        "system": "s",
        "size_bytes": SIZE,
        "keys_per_pass": 8,
        "batch": 0,
        "passes": 2,
        "uid": 11,
        "run": "t",
        **extra,
    }
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(w.cell, p) for w, p in zip(workers, pair_parts(msg), strict=True)]
        return [f.result(timeout=30) for f in futures]


def test_each_hand_off_is_read_by_the_other_worker_before_the_next_put() -> None:
    driver = DictStore()
    events: list[str] = []
    put_one, get_one = driver.put_one, driver.get_one

    def put_spy(key: str, src: Array, res: PassResult) -> bool:
        events.append(f"put {key}")
        return put_one(key, src, res)

    def get_spy(key: str, dst: Array, res: PassResult) -> Result:
        events.append(f"get {key}")
        return get_one(key, dst, res)

    driver.put_one = put_spy  # type: ignore[method-assign]
    driver.get_one = get_spy  # type: ignore[method-assign]
    writer, reader = _pair_cell(_linked_pair(driver), "hand-off")
    keys = [e.split()[1] for e in events[::2]]
    assert events == [f"{op} {k}" for k in keys for op in ("put", "get")]
    assert len(set(keys)) == 16
    assert all(key_writer(k) == 0 for k in keys)  # worker 0's keys
    get, hand = reader["get"], reader["handoff"]
    assert get["bytes_verified"] == get["bytes_read"] == 16 * SIZE
    assert get["wrong"] == get["misses"] == hand["unacknowledged"] == 0
    assert len(hand["latency_us"]) == len(hand["signal_us"]) == len(get["durations_us"]) == 16
    pairs = zip(hand["latency_us"], get["durations_us"], strict=True)
    assert all(latency >= read for latency, read in pairs)  # the latency includes the read
    assert len(writer["handoff"]["pipe_one_way_us"]) == PINGS
    assert writer["put"]["failures"] == 0
    assert not driver.data  # the writer removed its keys


@pytest.mark.parametrize(("store", "wrong", "misses"), [(FlipsAByte, 2, 0), (LosesAKey, 0, 2)])
def test_a_hand_off_miss_and_a_wrong_block_are_counted(
    store: type[DictStore], wrong: int, misses: int
) -> None:
    _writer, reader = _pair_cell(_linked_pair(store()), "hand-off")
    assert reader["get"]["wrong"] == wrong
    assert reader["get"]["misses"] == misses  # LosesAKey acknowledged the put it dropped
    assert reader["get"]["bytes_verified"] == (16 - wrong - misses) * SIZE


class DictFlow:
    label = "in + get"

    def __init__(self, store: DictStore) -> None:
        self.store = store

    def query(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.store.data for k in keys]

    def read(self, keys: Sequence[str], dsts: Sequence[Array], res: PassResult) -> list[Result]:
        return self.store.get_many(keys, dsts, res)

    def index_calls(self) -> dict[str, int] | None:
        return None


@pytest.mark.parametrize(("store", "misses"), [(DictStore, 0), (LosesAKey, 2)])
def test_the_engine_flow_queries_then_reads_the_hits_of_the_other_workers_batch(
    monkeypatch: pytest.MonkeyPatch, store: type[DictStore], misses: int
) -> None:
    driver = store()
    monkeypatch.setattr(pair_cells, "engine_flows", lambda d: {"in": DictFlow(d)})
    writer, reader = _pair_cell(_linked_pair(driver), "engine", batch=4, queries=["in"])
    flow = reader["engine"]["in"]
    # 2 passes x 2 batches of 4 keys; the writer put 3 of each batch (one lost by LosesAKey)
    assert flow["batches"] == len(flow["query_us"]) == len(flow["flow_us"]) == 4
    assert flow["keys_asked"] == 16
    assert flow["misses"] == misses
    assert flow["hits"] == 12 - misses
    assert flow["phantoms"] == flow["wrong"] == flow["read_misses"] == 0
    assert flow["bytes_verified"] == flow["bytes_read"] == (12 - misses) * SIZE
    assert writer["engine"]["in"]["put_failures"] == 0
    assert not driver.data
