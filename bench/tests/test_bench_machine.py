"""The machine limits the benchmarks print beside their numbers."""

from __future__ import annotations

import multiprocessing

from kvpool_bench.machine import round_trip_us


def test_round_trip_floor_times_each_request_size_and_leaves_no_process_behind() -> None:
    floor = round_trip_us(request_bytes=(64, 16384), calls=50)
    assert set(floor) == {"64B_p50_us", "16384B_p50_us"}
    # A loopback round trip between two processes: more than nothing, far less than a second.
    assert all(0 < us < 1e6 for us in floor.values())
    assert multiprocessing.active_children() == []
