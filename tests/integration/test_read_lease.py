"""Leader leases on real master processes: every acknowledged write is found by every later
lookup, whoever asks, also around a paused leader (raft_master/lease.py; the partition cases
are in test_lease_raft.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.errors import NotLeaderError, UnavailableError
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.raft_master.local_group import LocalMasterGroup
from tests.integration.conftest import ClusterFactory
from tests.integration.test_master_group import FAST_RAFT, call, commit, direct, register_node

pytestmark = pytest.mark.integration


def test_a_paused_leader_woken_up_never_answers_a_lookup_from_its_old_copy(
    tmp_path: Path,
) -> None:
    with LocalMasterGroup(tmp_path, 3, in_memory=True, settings=FAST_RAFT) as g:
        g.start()

        async def run() -> None:
            old = await g.wait_leader()
            client = MasterClient(g.grpc_addresses)
            try:
                node = await register_node(client, "lease")
                await commit(client, ["before"], node)
                old_term = (await g.status(old)).master.term
                g.pause(old)
                paused = time.monotonic()
                new = await g.wait_leader(exclude=(old,))
                elected_s = time.monotonic() - paused
                after = await commit(client, ["after-pause"], node)  # acknowledged by the new
                assert (await g.status(new)).master.term > old_term
                # Ask the paused master: the request waits in its socket until it wakes up.
                asking = asyncio.ensure_future(
                    direct(
                        g.grpc_addresses[old],
                        "Lookup",
                        master_pb2.LookupRequest(keys=["after-pause", "before"]),
                        timeout_s=5.0,
                    )
                )
                await asyncio.sleep(0.3)
                g.resume(old)
                try:
                    answer = await asking
                except (NotLeaderError, UnavailableError) as refused:
                    print(f"\nwoken leader refused: {type(refused).__name__}")
                else:  # it may answer only once it has caught up: then it must know the write
                    found = {e.key: e.found for e in answer.entries}
                    assert found == {"after-pause": True, "before": True}, answer
                    assert answer.revision >= after.revision
                lookup = await call(
                    client, "Lookup", master_pb2.LookupRequest(keys=["after-pause", "before"])
                )
                assert [e.found for e in lookup.entries] == [True, True]
                print(f"new leader ready {elected_s:.2f}s after the pause")
            finally:
                g.resume(old)
                await client.close()

        asyncio.run(run())


def test_a_block_put_by_one_client_is_read_by_another_at_once(
    cluster_factory: ClusterFactory,
) -> None:
    """The hand-off of disaggregated prefill and decode: the reader has never met the leader
    and asks right after the writer's put returned. Without leases 14 of 300 4 KiB and 23 of
    300 1 MiB hand-offs missed here (the reader's lookup reached a follower)."""
    cluster = cluster_factory(masters=3, nodes=2, cpu_cache_size="256MiB")
    masters = cluster.client_master_addresses
    with Client(masters, timeout_s=3.0) as writer, Client(masters, timeout_s=3.0) as reader:
        for size, count in ((4096, 300), (1 << 20, 60)):
            value = os.urandom(size)
            buffer = bytearray(size)
            for i in range(count):
                key = f"handoff/{size}/{i}/{os.urandom(4).hex()}"
                assert writer.put(key, value)
                assert reader.get_into(key, buffer, strict=True) == size, key
                assert buffer == value


def test_an_overwrite_is_read_by_a_client_holding_the_old_entry(
    cluster_factory: ClusterFactory,
) -> None:
    """The old value had a replica on a node the new one is not placed on: the writer deletes
    it there before its put returns, so a reader whose cached entry still names it misses
    there and looks the key up again, instead of reading the old value for the cache's TTL."""
    cluster = cluster_factory(masters=3, nodes=2, cpu_cache_size="64MiB")
    masters = cluster.client_master_addresses
    with (
        Client(masters, timeout_s=3.0, replicas=2) as first,
        Client(masters, timeout_s=3.0, replicas=1) as second,
        Client(masters, timeout_s=3.0) as reader,
    ):
        for i in range(20):
            key = f"overwrite/{i}"
            assert first.put(key, b"old" * 100)
            assert reader.get(key) == b"old" * 100  # cached: both replicas
            assert second.put(key, b"new" * 100)  # on one node: the other copy is orphaned
            assert reader.get(key, strict=True) == b"new" * 100, key
