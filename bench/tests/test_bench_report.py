"""The numbers of ``kvpool-bench peers``: rates over rounds, ratios within rounds, targets, the
table, and how cells are planned. Pure: no process, no socket."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from kvpool.errors import ConfigError
from kvpool_bench import report as bench_report
from kvpool_bench.peers import PeersOptions, plan_cell

MiB = 1 << 20


def _op(passes: list[tuple[float, float, int, int]], durations: list[float], **counts: int) -> Any:
    out: dict[str, Any] = {
        "passes": [{"start": s, "end": e, "keys": k, "bytes": b} for s, e, k, b in passes],
        "durations_us": durations,
        "errors": [],
    }
    out.update(counts)
    return out


def _record(system: str, rnd: int, gbps: float, *, size: int = MiB, clients: int = 1) -> Any:
    """One round of one system at ``gbps`` for both put and get (1 s passes)."""
    nbytes = int(gbps * 1e9)
    keys = nbytes // size
    worker = {
        "put": _op([(0.0, 1.0, keys, nbytes)], [100.0 * (rnd + 1)], failures=0),
        "get": _op(
            [(0.0, 1.0, keys, nbytes)],
            [50.0 * (rnd + 1)],
            misses=0,
            wrong=0,
            bytes_read=nbytes,
            bytes_verified=nbytes,
        ),
    }
    return {
        "system": system,
        "mode": "single",
        "size_bytes": size,
        "clients": clients,
        "batch": 0,
        "round": rnd,
        "workers": [worker] * clients,
    }


def test_percentile_is_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert bench_report.percentile(samples, 0.99) == 99.0
    assert bench_report.percentile(samples, 0.5) == 50.0
    assert bench_report.percentile([7.0], 0.99) == 7.0
    assert math.isnan(bench_report.percentile([], 0.5))


def test_two_workers_are_timed_from_first_start_to_last_end() -> None:
    a = _op([(0.0, 1.0, 10, 1000), (5.0, 6.0, 10, 1000)], [])
    b = _op([(0.5, 2.0, 10, 1000), (5.0, 5.5, 10, 1000)], [])
    rate = bench_report.round_rate([a, b])
    # pass 0 spans 0.0..2.0, pass 1 spans 5.0..6.0: 4000 bytes in 3 s
    assert rate["time_s"] == pytest.approx(3.0)
    assert rate["bytes"] == 4000
    assert rate["GBps"] == pytest.approx(4000 / 3.0 / 1e9)
    assert rate["keys_per_s"] == pytest.approx(40 / 3.0)


def test_cells_report_the_median_round_and_pool_latencies() -> None:
    records = [_record("kvpool", r, g) for r, g in enumerate([1.0, 3.0, 2.0])]
    cells = bench_report.summarize_cells(records, {"kvpool": {"get": "get_into"}})
    get = next(c for c in cells if c["op"] == "get")
    assert get["GBps"] == pytest.approx(2.0, rel=1e-3)
    assert get["p50_us"] == 100.0  # 50, 100, 150 pooled
    assert get["api"] == "get_into"
    assert get["all_bytes_verified"]
    assert [c["op"] for c in cells] == ["put", "get"]


def test_a_wrong_block_is_never_called_verified() -> None:
    rec = _record("redis", 0, 1.0)
    rec["workers"][0]["get"]["wrong"] = 1
    cells = bench_report.summarize_cells([rec], {})
    get = next(c for c in cells if c["op"] == "get")
    assert get["wrong"] == 1
    assert not get["all_bytes_verified"]


def test_ratios_are_taken_within_each_round() -> None:
    # kvpool 1,2,4 GB/s; the peer 2,4,8: a ratio of 0.5 in every round, whatever the noise
    records = [_record("kvpool", r, g) for r, g in enumerate([1.0, 2.0, 4.0])]
    records += [_record("mooncake", r, g) for r, g in enumerate([2.0, 4.0, 8.0])]
    limits = [
        {"round": r, "memcpy_GBps": 10.0 * (r + 1), "loopback_tcp_GBps": 4.0 * (r + 1)}
        for r in range(3)
    ]
    cells = bench_report.summarize_cells(records, {})
    bench_report.add_ratios(cells, limits)
    kv = next(c for c in cells if c["system"] == "kvpool" and c["op"] == "get")
    mc = next(c for c in cells if c["system"] == "mooncake" and c["op"] == "get")
    assert kv["vs"]["mooncake"]["GBps_ratio"] == pytest.approx(0.5, rel=1e-3)
    assert kv["vs"]["mooncake"]["p50_ratio"] == pytest.approx(1.0)
    assert "vs" not in mc  # ratios are kvpool's, to each peer
    # 1/10, 2/20, 4/30 of memcpy: median 0.1
    assert kv["of_limit"]["memcpy"] == pytest.approx(0.1, rel=1e-3)
    assert mc["of_limit"]["loopback_tcp"] == pytest.approx(0.5, rel=1e-3)


def test_targets_are_met_missed_or_not_measured() -> None:
    records = [_record("kvpool", 0, 3.0), _record("mooncake", 0, 1.0)]
    records += [_record("kvpool", 0, 1.0, clients=2)]  # 2 x 1.0: an aggregate of 2.0
    cells = bench_report.summarize_cells(records, {})
    bench_report.add_ratios(cells, [{"round": 0, "memcpy_GBps": 20.0, "loopback_tcp_GBps": 4.0}])
    targets = {t["target"].split(":")[0]: t for t in bench_report.evaluate_targets(cells)}
    get_target = targets["get_into of >= 1 MiB over TCP, one key per call"]
    assert get_target["status"] == "met"  # 3.0 / 1.0 >= 1.5
    assert "1.0 MiB: 3.00x" in get_target["detail"]
    assert targets["two client processes"]["status"] == "missed"  # 2.0 < 3.0
    assert targets["same-host client through shared memory"]["status"] == "not measured"


def _doc(cells: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "options": {"rounds": 1},
        "host": {"cpus": 2},
        "limits": {
            "memcpy_GBps": 20.0,
            "memcpy_size_bytes": 64 * MiB,
            "loopback_tcp_GBps": 4.0,
        },
        "systems": {
            "kvpool": {"status": "measured", "api": {"client": "kvpool.Client", "get": "get_into"}},
            "mooncake": {"status": "measured", "api": {"client": "mooncake"}},
            "redis": {
                "status": "skipped",
                "reason": "redis-server is not installed",
                "install": "apt-get install redis-server",
            },
        },
        "cells": cells,
        "verification": {
            "bytes_read": 10,
            "bytes_verified": 10,
            "wrong": 0,
            "misses": 0,
            "put_failures": 0,
        },
        "targets": bench_report.evaluate_targets(cells),
    }


def test_the_table_shows_rows_ratios_and_skipped_peers() -> None:
    records = [_record("kvpool", 0, 3.0), _record("mooncake", 0, 1.5)]
    cells = bench_report.summarize_cells(records, {})
    bench_report.add_ratios(cells, [{"round": 0, "memcpy_GBps": 20.0, "loopback_tcp_GBps": 4.0}])
    text = bench_report.render_table(_doc(cells))
    assert re.search(r"^\s+redis\s+skipped: redis-server is not installed", text, re.M)
    assert "install: apt-get install redis-server" in text
    row = next(ln for ln in text.splitlines() if "kvpool" in ln and "3.000" in ln)
    assert "2.00x" in row  # vs mooncake
    assert "15.0%" in row  # of memcpy
    assert "75.0%" in row  # of loopback TCP
    assert "GET, one key per call" in text


@pytest.mark.parametrize("quick", [False, True])
def test_every_pass_fits_the_arena(quick: bool) -> None:
    opts = PeersOptions.quick_run() if quick else PeersOptions()
    for size in opts.sizes:
        for mode in ("single", "batch"):
            plan = plan_cell(opts, size, mode)
            assert plan.keys_per_pass * size <= opts.arena_bytes
            assert plan.passes >= 1
            assert plan.keys_per_pass >= 1
        batch = plan_cell(opts, size, "batch")
        assert batch.keys_per_pass % batch.batch == 0
        if size == 4096:
            assert batch.batch == 256  # the issue's "256 per call"


def test_an_engine_batch_is_128_keys_of_1_mib_where_the_arena_holds_them() -> None:
    """Issue 13's engine target is 128 x 1 MiB: --arena 128MiB (or more) makes it one batch."""
    assert plan_cell(PeersOptions(arena_bytes=256 << 20), 1 << 20, "engine").batch == 128
    assert plan_cell(PeersOptions(arena_bytes=128 << 20), 1 << 20, "engine").batch == 128
    assert plan_cell(PeersOptions(), 1 << 20, "engine").batch == 64  # the default 64 MiB arena
    assert plan_cell(PeersOptions(arena_bytes=1 << 30), 4 << 20, "engine").batch == 32  # 128 MiB
    assert "arena" in " ".join(PeersOptions(arena_bytes=1024).validate())


def test_bad_options_are_refused_by_name() -> None:
    bad = PeersOptions(sizes=(8,), rounds=0, clients=(3,), peers=("memcached",))
    errors = " ".join(bad.validate())
    for word in ("sizes", "rounds", "clients", "peers"):
        assert word in errors
    from kvpool_bench.peers import run_peers

    with pytest.raises(ConfigError):
        run_peers(bad)


def test_markdown_has_one_table_per_op_mode_and_client_count() -> None:
    records = [_record("kvpool", 0, 3.0), _record("mooncake", 0, 1.5)]
    records += [_record("kvpool", 0, 1.0, clients=2), _record("mooncake", 0, 1.0, clients=2)]
    cells = bench_report.summarize_cells(records, {})
    bench_report.add_ratios(cells, [{"round": 0, "memcpy_GBps": 20.0, "loopback_tcp_GBps": 4.0}])
    text = bench_report.render_markdown(_doc(cells))
    assert "**GET, one key per call, one client process**" in text
    assert "**PUT, one key per call, 2 client processes**" in text
    assert "| kvpool ÷ mooncake |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 1.0 MiB") and "2.00x" in ln)
    assert "3.000 (2,861)" in row  # GB/s (keys/s) of kvpool
    assert "75.0%" in row  # of loopback TCP


@pytest.mark.parametrize(
    ("transport_arg", "async_client", "api", "expected"),
    [
        (False, False, "auto", ["kvpool"]),
        (True, False, "auto", ["kvpool-tcp", "kvpool-shm"]),
        (True, True, "auto", ["kvpool-tcp", "kvpool-tcp-async", "kvpool-shm"]),
        (True, True, "sync", ["kvpool-tcp", "kvpool-shm"]),
        (True, True, "async", ["kvpool-tcp-async", "kvpool-shm-async"]),
        (False, True, "both", ["kvpool", "kvpool-async"]),
    ],
)
def test_kvpool_is_measured_with_whatever_the_client_offers(
    transport_arg: bool, async_client: bool, api: str, expected: list[str]
) -> None:
    from kvpool_bench.peers import PeersBench

    bench = PeersBench(PeersOptions(kvpool_api=api))
    bench._kvpool_systems(
        ["127.0.0.1:1"], {"transport_arg": transport_arg, "async_client": async_client}
    )
    assert list(bench.systems) == expected
    for state in bench.systems.values():
        assert state.status == "measured"
        assert state.spec["api"] == ("async" if state.name.endswith("-async") else "sync")
    bench = PeersBench(PeersOptions(kvpool_api="async"))
    bench._kvpool_systems(["127.0.0.1:1"], {"transport_arg": False, "async_client": False})
    assert bench.systems["kvpool-async"].status == "failed"


def _first_read(system: str, rnd: int, gbps: float, *, size: int, p50_us: float) -> Any:
    """One round of a first read by one reader: worker 0 only put, worker 1 only got."""
    rec = _record(system, rnd, gbps, size=size)
    both = rec["workers"][0]
    rec["workers"] = [{"put": both["put"]}, {"get": {**both["get"], "durations_us": [p50_us]}}]
    rec["mode"] = "first-read"
    return rec


def test_first_reads_are_their_own_cells_with_issue_13s_targets() -> None:
    records = [
        _first_read("kvpool-tcp", 0, 3.0, size=MiB, p50_us=300.0),
        _first_read("mooncake", 0, 1.5, size=MiB, p50_us=600.0),
        _first_read("kvpool-tcp", 0, 0.1, size=4096, p50_us=300.0),
        _first_read("mooncake", 0, 0.1, size=4096, p50_us=200.0),
        _first_read("kvpool-shm", 0, 6.0, size=MiB, p50_us=100.0),
        _first_read("redis", 0, 1.0, size=MiB, p50_us=700.0),
        _record("kvpool-tcp", 0, 1.0),  # a single-key cell: beside, not mixed in
    ]
    apis = {"kvpool-tcp": {"get": "get_into", "batch_get": "batch_get_into"}}
    cells = bench_report.summarize_cells(records, apis)
    bench_report.add_ratios(cells, [{"round": 0, "memcpy_GBps": 20.0, "loopback_tcp_GBps": 4.0}])
    first = {(c["system"], c["op"], c["size_bytes"]): c for c in cells if c["mode"] == "first-read"}
    get = first[("kvpool-tcp", "get", MiB)]
    assert get["api"] == "get_into"
    assert get["keys_per_call"] == 1
    assert get["GBps"] == pytest.approx(3.0, rel=1e-3)  # the reader's passes only
    assert get["vs"]["mooncake"]["GBps_ratio"] == pytest.approx(2.0, rel=1e-3)
    assert get["vs"]["mooncake"]["p50_ratio"] == pytest.approx(0.5)
    # every system's ratio to Mooncake: a peer's too, to each other peer
    assert first[("redis", "get", MiB)]["vs"]["mooncake"]["GBps_ratio"] == pytest.approx(
        1 / 1.5, rel=1e-3
    )
    assert set(first[("mooncake", "get", MiB)]["vs"]) == {"redis"}
    assert first[("kvpool-tcp", "put", MiB)]["calls"] == 1  # the writer's puts
    single = [c for c in cells if c["mode"] == "single" and c["op"] == "get"]
    assert len(single) == 1
    assert single[0]["GBps"] == pytest.approx(1.0, rel=1e-3)

    targets = {t["target"].split(":")[0]: t for t in bench_report.evaluate_targets(cells)}
    big = targets["first read of >= 1 MiB over TCP, one key per call"]
    assert (big["group"], big["status"]) == ("first-read", "met")  # 2.0x >= 1.5x
    small = targets["first read of 4 KiB and 64 KiB over TCP"]
    assert small["status"] == "missed"  # 300 us vs 200 us
    assert targets["first read through shared memory"]["status"] == "met"  # 6 >= 5 at 1 MiB
    assert targets["two client processes"]["status"] == "not measured"
    text = bench_report.render_table(_doc(cells))
    assert "GET, first read by another client, one key per call" in text
    assert "first-read targets:" in text
    md = bench_report.render_markdown(_doc(cells))
    assert "**GET, first read by another client, one key per call, one reader" in md


def test_issue_13s_targets_appear_only_with_first_reads() -> None:
    cells = bench_report.summarize_cells([_record("kvpool-tcp", 0, 1.0)], {})
    targets = bench_report.evaluate_targets(cells)
    assert len(targets) == 7
    assert {t["group"] for t in targets} == {"data-path"}


def test_first_read_is_a_mode_of_its_own_and_planned_like_single() -> None:
    opts = PeersOptions(modes=("single", "first-read"))
    assert opts.validate() == []
    assert "modes" in " ".join(PeersOptions(modes=("first",)).validate())
    for size in opts.sizes:
        assert plan_cell(opts, size, "first-read") == plan_cell(opts, size, "single")


def _hand_off_record(system: str, *, misses: int) -> Any:
    writer = {
        "put": {"durations_us": [100.0, 300.0], "failures": 0, "errors": []},
        "handoff": {"pipe_one_way_us": [20.0, 30.0, 40.0]},
    }
    reader = {
        "get": {
            "durations_us": [50.0] * (2 - misses),
            "misses": misses,
            "wrong": 0,
            "bytes_read": 4096 * (2 - misses),
            "bytes_verified": 4096 * (2 - misses),
            "errors": [],
        },
        "handoff": {"latency_us": [200.0, 400.0], "signal_us": [10.0, 30.0], "unacknowledged": 0},
    }
    return {
        "system": system,
        "mode": "hand-off",
        "size_bytes": 4096,
        "round": 0,
        "workers": [writer, reader],
    }


def test_a_kvpool_hand_off_miss_is_a_loud_problem_and_a_peers_a_plain_one() -> None:
    from kvpool_bench import pair_report

    rows = pair_report.summarize_handoffs(
        [_hand_off_record("kvpool-tcp", misses=1), _hand_off_record("mooncake", misses=1)]
    )
    kv = rows[0]
    assert (kv["system"], kv["handoffs"], kv["misses"]) == ("kvpool-tcp", 2, 1)
    assert (kv["latency_p50_us"], kv["latency_p99_us"]) == (300.0, 400.0)
    assert (kv["put_p50_us"], kv["signal_p50_us"], kv["pipe_one_way_p50_us"]) == (200, 20, 30)
    problems = pair_report.pair_problems(rows, [])
    assert problems[0].startswith("HAND-OFF MISS (kvpool-tcp 4.0 KiB)")
    assert "read-after-ack" in problems[0]
    assert problems[1].startswith("mooncake hand-off")
    text = "\n".join(pair_report.table_lines({"handoffs": rows}))
    assert "!!! kvpool-tcp 4.0 KiB: 1 HAND-OFF MISS" in text
    assert "!!! mooncake" not in text


def test_engine_rates_are_of_the_whole_flow_and_index_calls_per_batch() -> None:
    from kvpool_bench import pair_report

    flow = {
        "label": "prefix_match + batch_get_into",
        "batches": 4,
        "query_us": [100.0, 100.0, 200.0, 200.0],
        "flow_us": [250_000.0] * 4,  # 1 s in all
        "keys_asked": 16,
        "hits": 12,
        "misses": 0,
        "phantoms": 0,
        "read_misses": 0,
        "wrong": 0,
        "bytes_read": 12 * MiB,
        "bytes_verified": 12 * MiB,
        "put_failures": 0,
        "index_calls": {"Lookup": 4},
        "errors": [],
    }
    rec = {
        "system": "kvpool-tcp",
        "mode": "engine",
        "size_bytes": MiB,
        "batch": 4,
        "round": 0,
        "workers": [{"engine": {}}, {"engine": {"prefix_match": flow}}],  # writer, reader
    }
    (row,) = pair_report.summarize_engine([rec])
    assert row["batches_per_s"] == pytest.approx(4.0)
    assert row["GBps"] == pytest.approx(12 * MiB / 1e9)
    assert row["query_p50_us"] == 150.0
    assert row["index_calls_per_batch"] == {"Lookup": 1.0}
    assert row["calls"] == "prefix_match + batch_get_into"


def test_the_engines_table_says_which_system_was_skipped_and_why() -> None:
    from kvpool_bench import engines

    row = {"set_pages_per_s": 2000.0, "exists_us": 180.0, "get_pages_per_s": 6000.0}
    doc = {
        "systems": {
            "mooncake": {
                "status": "skipped: libibverbs.so.1 missing (apt-get install libibverbs1)"
            },
            "kvpool-native-tcp": {"status": "measured"},
        },
        "results": {"1MiB": {"kvpool-native-tcp": row}},
        "verification": {"pages_read": 128, "wrong": 0, "failed": 0},
    }
    text = engines.render_table(doc)
    assert "mooncake: skipped: libibverbs.so.1 missing (apt-get install libibverbs1)" in text
    assert "kvpool-native-tcp: " not in text  # measured systems are rows, not notes
    assert " 1MiB kvpool-native-tcp" in text


def test_the_peers_command_line_takes_the_arena_and_the_engine_batch() -> None:
    from kvpool_bench.cli import _parser
    from kvpool_bench.peers_cli import options_from_args

    args = _parser().parse_args(
        ["peers", "--modes", "engine", "--arena", "256MiB", "--engine-batch", "128"]
    )
    opts = options_from_args(args)
    assert (opts.arena_bytes, opts.engine_batch_keys) == (256 << 20, 128)
    assert plan_cell(opts, 1 << 20, "engine").batch == 128
    with pytest.raises(ConfigError, match="arena"):
        options_from_args(_parser().parse_args(["peers", "--arena", "lots"]))
