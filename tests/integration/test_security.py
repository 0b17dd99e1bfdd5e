"""A cluster with a cluster token, as real processes on 127.0.0.1: clients with the right token
work (sync client: frame RPC port + blocking data plane; async client: frame RPC port on its
event loop + event-loop data plane), a missing or wrong token is refused with a clear error,
node registration included; a process asked to listen beyond loopback without a token refuses
to start."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.client.aio import AsyncClient
from kvpool.errors import UnauthenticatedError
from kvpool.launcher.cluster import LocalCluster
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Op
from kvpool.security import Security, read_token
from kvpool.transports import open_blocking
from kvpool.transports.calls import Call

pytestmark = pytest.mark.integration

WRONG = "not-this-clusters-token-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("secured"),
        masters=1,
        nodes=1,
        cpu_cache_size="64MiB",
        cluster_token=True,
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_the_right_token_works_on_every_path(secured: LocalCluster) -> None:
    assert secured.token_file
    masters = secured.client_master_addresses
    with Client(masters, cluster_token_file=secured.token_file, strict=True) as kv:
        assert kv.put("sec/a", b"a" * 5000)
        assert kv.get("sec/a") == b"a" * 5000
        assert kv.batch_get(["sec/a"]) == [b"a" * 5000]

    async def main() -> None:
        kv = AsyncClient(
            masters, cluster_token_file=secured.token_file, strict=True, transport="tcp"
        )
        try:
            assert await kv.put("sec/b", b"b" * 3000)
            assert await kv.get("sec/b") == b"b" * 3000
            # Lookup and CommitPuts went over the masters' frame RPC port (authenticated).
            rpc_pool = kv._masters._rpc_pool
            assert any(c.is_open for conns in rpc_pool._conns.values() for c in conns)
        finally:
            await kv.close()

    asyncio.run(main())


@pytest.mark.parametrize("token", ["", WRONG])
def test_a_missing_or_wrong_token_is_refused_clearly(secured: LocalCluster, token: str) -> None:
    masters = secured.client_master_addresses
    expected = "wrong cluster token" if token else "requires its cluster token"
    with Client(masters, cluster_token=token, strict=True, timeout_s=2.0) as kv:
        with pytest.raises(UnauthenticatedError, match=expected):
            kv.get("sec/a")
        with pytest.raises(UnauthenticatedError, match=expected):
            kv.put("sec/c", b"c")
    with Client(masters, cluster_token=token, timeout_s=2.0) as kv:  # not strict: a miss
        assert kv.get("sec/a") is None
        assert kv.put("sec/c", b"c") is False


def test_node_registration_needs_the_token(secured: LocalCluster) -> None:
    async def main() -> None:
        masters = MasterClient(secured.master_addresses, security=Security(token=WRONG.encode()))
        try:
            with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
                await masters.call(
                    "RegisterNode",
                    master_pb2.RegisterNodeRequest(node_id="intruder"),
                    deadline=asyncio.get_running_loop().time() + 3,
                )
        finally:
            await masters.close()

    asyncio.run(main())


def test_a_non_loopback_bind_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvpool", "node", "--data-listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 2
    assert "data_listen: 0.0.0.0:0 is not a loopback address" in result.stderr
    assert "cluster_token_file" in result.stderr


def test_the_masters_frame_rpc_port_needs_the_token(secured: LocalCluster) -> None:
    async def main() -> str:
        token = read_token("", secured.token_file)
        masters = MasterClient(secured.master_addresses, security=Security(token=token))
        try:
            members = await masters.call(
                "GetMembers",
                master_pb2.GetMembersRequest(),
                deadline=asyncio.get_running_loop().time() + 5,
            )
        finally:
            await masters.close()
        return str(members.rpc_address)

    rpc = asyncio.run(main())
    assert rpc, "the master offers no frame RPC port"
    address = f"tcp://{rpc}"
    token = read_token("", secured.token_file)
    conn = open_blocking(address, 5.0, token)  # the right token: admitted
    conn.close()
    with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
        open_blocking(address, 5.0, WRONG.encode())
    conn = open_blocking(address, 5.0)  # no token: the first frame is refused
    try:
        call = Call(Op.PING, b"")
        with pytest.raises(UnauthenticatedError, match="requires the cluster token"):
            conn.exchange([call], time.monotonic() + 5)
    finally:
        conn.close()
