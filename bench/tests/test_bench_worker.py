"""The bench worker checks every byte a get returns: a store that loses, garbles, misplaces or
half-writes a block is caught, and an honest one is verified in full — also in a first read,
where one worker puts and the other reads and checks the writer's bytes. In-process, with
stores that live in a dict."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvpool_bench.drivers import Array, PassResult, Result, SyncDriver
from kvpool_bench.peers import first_read_parts
from kvpool_bench.worker import POISON, Worker

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
        if got is not None and key.endswith("/3"):
            dst[100] ^= 0xFF
        return got


class LosesAKey(DictStore):
    def put_one(self, key: str, src: Array, res: PassResult) -> bool:
        return key.endswith("/5") or super().put_one(key, src, res)


class ServesSlotZero(DictStore):
    """Every key reads the block of slot 0 of the same pass (a misplaced read)."""

    def get_one(self, key: str, dst: Array, res: PassResult) -> Result:
        return self.read(key.rsplit("/", 1)[0] + "/0", dst)


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
    assert all(k.split("/")[3] == "0" for k in reads)  # ... and all of them worker 0's
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
