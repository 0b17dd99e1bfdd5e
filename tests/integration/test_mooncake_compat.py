"""kvpool.compat.mooncake.MooncakeDistributedStore: a script written for Mooncake Store runs
unchanged on kvpool (and, where Mooncake is installed, on Mooncake Store too: its expectations
are Mooncake's), plus what the compat layer decides: tenant namespaces and remove_all, setup's
signatures, registered-buffer checks, failure codes within the deadline, replicas, tensors."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.client.sync import Client
from kvpool.compat import mooncake as mc
from kvpool.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvpool.launcher.cluster import LocalCluster

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("mooncake_user_script.py")
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("mooncake-compat"),
        masters=1,
        nodes=2,
        cpu_cache_size="128MiB",
        in_memory=True,
    )
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def store(cluster: LocalCluster) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    rc = s.setup(
        "localhost", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "",
        ",".join(cluster.client_master_addresses),
    )  # fmt: skip
    assert rc == 0
    try:
        yield s
    finally:
        s.close()


def _run_script(impl: str, master: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), impl, master],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_mooncake_user_script_runs_on_kvpool(cluster: LocalCluster) -> None:
    done = _run_script("kvpool", ",".join(cluster.client_master_addresses))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "SCRIPT OK" in done.stdout


def _mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations)))
    return directory if (directory / "mooncake_master").exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    _mooncake_dir() is None,
    reason="Mooncake Store is not installed (pip install mooncake-transfer-engine-non-cuda)",
)
def test_the_same_script_runs_on_mooncake_store(tmp_path: Path) -> None:
    """The script's expectations are Mooncake's own: checked against Mooncake Store itself."""
    package = _mooncake_dir()
    assert package is not None
    port = _free_port()
    with (tmp_path / "mooncake_master.log").open("wb") as log:
        master = subprocess.Popen(
            [
                str(package / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={_free_port()}",
                "--enable_metric_reporting=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    time.sleep(0.1)
            done = _run_script("mooncake", f"127.0.0.1:{port}")
        finally:
            master.terminate()
            try:
                master.wait(10)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait(10)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "SCRIPT OK" in done.stdout


def test_unregistered_memory_is_refused_before_it_is_touched(
    store: MooncakeDistributedStore,
) -> None:
    buf = np.arange(4096, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert store.put_from("compat/zc", ptr, buf.nbytes) == mc.INVALID_PARAMS
    assert store.register_buffer(ptr, 1024) == 0
    assert store.put_from("compat/zc", ptr, 2048) == mc.INVALID_PARAMS  # past the region
    assert store.put_from("compat/zc", ptr + 512, 512) == 0  # inside it
    assert store.get_into("compat/zc", ptr + 100, 2000) == mc.INVALID_PARAMS
    assert store.batch_put_from(["a", "b"], [ptr, ptr], [16]) == [mc.INVALID_PARAMS] * 2
    assert store.register_buffer(0, 10) == mc.INVALID_PARAMS
    assert store.unregister_buffer(ptr) == 0
    assert store.unregister_buffer(ptr) == mc.INVALID_PARAMS
    assert store.get_into("compat/zc", ptr, 512) == mc.INVALID_PARAMS


def test_error_codes(store: MooncakeDistributedStore) -> None:
    raw = (ctypes.c_char * 64)()
    ptr = ctypes.addressof(raw)
    assert store.register_buffer(ptr, 64) == 0
    assert store.put("compat/big", b"x" * 100) == 0
    assert store.get_into("compat/big", ptr, 64) == mc.BUFFER_OVERFLOW
    assert store.batch_get_into(["compat/big", "compat/none"], [ptr, ptr], [64, 64]) == [
        mc.BUFFER_OVERFLOW,
        mc.OBJECT_NOT_FOUND,
    ]
    assert store.get_into("compat/none", ptr, 64) == mc.OBJECT_NOT_FOUND
    assert store.get_size("compat/none") == mc.OBJECT_NOT_FOUND
    assert store.remove("compat/none") == mc.OBJECT_NOT_FOUND
    assert store.put("", b"x") == mc.INVALID_KEY
    assert store.put("compat/k", object()) == mc.INVALID_PARAMS
    assert store.put_batch(["a"], [b"1", b"2"]) == mc.INVALID_PARAMS
    assert store.get_hostname() == "localhost"


def test_replica_num_is_honoured(store: MooncakeDistributedStore) -> None:
    config = ReplicateConfig()
    config.replica_num = 2
    assert store.put("compat/two", b"twice", config) == 0
    assert store.put_batch(["compat/two-a", "compat/two-b"], [b"a", b"b"], config) == 0
    assert store.get_batch(["compat/two", "compat/two-a", "compat/two-b"]) == [
        b"twice",
        b"a",
        b"b",
    ]
    assert len(store._clients) == 2  # one client per replica count


def _setup(store: MooncakeDistributedStore, cluster: LocalCluster, **kw: object) -> int:
    masters = ",".join(cluster.client_master_addresses)
    return store.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", masters, **kw)  # type: ignore[arg-type]


def test_remove_all_removes_the_tenants_objects_cluster_wide(
    cluster: LocalCluster, store: MooncakeDistributedStore
) -> None:
    """remove_all is Mooncake's "every object": here every object of the tenant, whoever put
    it, and nothing of another tenant or of native kvpool clients."""
    writer, other_tenant = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert _setup(writer, cluster) == 0
    assert _setup(other_tenant, cluster, tenant_id="other") == 0
    native = Client(cluster.client_master_addresses)
    try:
        assert writer.put_batch([f"compat/w{i}" for i in range(10)], [b"w"] * 10) == 0
        assert store.put("compat/mine", b"1") == 0
        assert other_tenant.put("compat/mine", b"theirs") == 0
        assert native.put("compat/native", b"n")
        assert store.remove_all() >= 11
        assert writer.batch_is_exist(["compat/w0", "compat/w9", "compat/mine"]) == [0, 0, 0]
        assert other_tenant.get("compat/mine") == b"theirs"
        assert native.get("compat/native") == b"n"
        assert store.remove_all(force=True) == 0
    finally:
        native.close()
        writer.close()
        other_tenant.close()


def test_tenants_do_not_see_each_others_keys(
    cluster: LocalCluster, store: MooncakeDistributedStore
) -> None:
    other = MooncakeDistributedStore()
    assert _setup(other, cluster, tenant_id="t2") == 0
    try:
        assert store.put("compat/same-name", b"default") == 0
        assert other.is_exist("compat/same-name") == 0
        assert other.put("compat/same-name", b"t2") == 0
        assert store.get("compat/same-name") == b"default"
        assert other.get("compat/same-name") == b"t2"
    finally:
        other.close()


def test_setup_takes_mooncakes_signatures(cluster: LocalCluster) -> None:
    """The 8th positional (SGLang passes its transfer engine there), Mooncake's keywords, and
    the one-dict form; a typo in the dict is refused, naming nothing silently."""
    masters = ",".join(cluster.client_master_addresses)
    s = MooncakeDistributedStore()
    try:
        assert (
            s.setup(
                "h", "P2PHANDSHAKE", 1 << 30, 16 << 20, "rdma", "mlx5_0", masters, object(),
                enable_ssd_offload=True, ssd_offload_path="/tmp/x", tenant_id="kw",
                enable_client_http_server=True, client_http_port=9301,
            )
            == 0
        )  # fmt: skip
        assert s.put("compat/kw", b"1") == 0
        assert s.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                        "master_server_addr": masters, "tenant_id": "kw",
                        "global_segment_size": 1 << 20, "protocol": "tcp"}) == 0  # fmt: skip
        assert s.get("compat/kw") == b"1"  # the same tenant again
        # LMCache 0.5's Mooncake connector: its legacy names, its defaults, as strings
        lmcache = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                   "global_segment_size": "3355443200", "local_buffer_size": "1073741824",
                   "protocol": "tcp", "device_name": "", "master_server_address": masters,
                   "tenant_id": "kw"}  # fmt: skip
        assert s.setup(lmcache) == 0
        assert s.get("compat/kw") == b"1"
        both = dict(lmcache, master_server_addr=masters, master_server_address="nowhere:1")
        assert s.setup(both) == 0  # the current name wins
        assert s.setup({"local_hostname": "h", "master_server_adr": masters}) == mc.INVALID_PARAMS
        assert s.setup({"metadata_server": "x", "master_server_addr": masters}) == mc.INVALID_PARAMS
        assert _setup(s, cluster, tenant_id="a/b") == mc.INVALID_PARAMS
        assert _setup(s, cluster, tenant_id="") == mc.INVALID_PARAMS
        assert s.setup_dummy(1 << 30, 16 << 20, "127.0.0.1:50052") == mc.NOT_SUPPORTED
    finally:
        s.close()


def test_health_check(cluster: LocalCluster) -> None:
    s = MooncakeDistributedStore()
    assert s.health_check() == mc.HC_NOT_INITIALIZED
    assert _setup(s, cluster) == 0
    assert s.health_check() == mc.HC_HEALTHY
    s.close()
    assert s.health_check() == mc.HC_NOT_INITIALIZED


def test_a_failed_store_answers_codes_within_the_deadline(tmp_path: Path) -> None:
    """Masters gone after setup: every call answers a Mooncake failure code (never raises),
    within about the configured deadline."""
    c = LocalCluster(tmp_path / "c", masters=1, nodes=1, cpu_cache_size="128MiB", in_memory=True)
    s = MooncakeDistributedStore()
    try:
        c.start()
        assert _setup(s, c, timeout_s=0.5) == 0
        assert s.put("compat/f", b"v") == 0
        c.stop()
        started = time.monotonic()
        assert s.put("compat/g", b"v") in (mc.RPC_FAIL, mc.RPC_TIMEOUT)
        assert s.is_exist("compat/f") in (mc.RPC_FAIL, mc.RPC_TIMEOUT)
        assert s.get("compat/f") == b""
        assert s.get_buffer("compat/f") is None
        assert s.batch_remove(["compat/f"])[0] in (mc.RPC_FAIL, mc.RPC_TIMEOUT)
        assert s.remove_all() in (mc.RPC_FAIL, mc.RPC_TIMEOUT)
        assert s.health_check() == mc.HC_MASTER_UNREACHABLE
        assert time.monotonic() - started < 7 * 3.0
    finally:
        s.close()
        c.stop()


def test_register_buffer_refuses_memory_it_must_not_touch(
    store: MooncakeDistributedStore,
) -> None:
    read_only = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    try:
        ro_ptr = np.frombuffer(read_only, dtype=np.uint8).ctypes.data
        assert store.register_buffer(ro_ptr, 4096) == mc.INVALID_PARAMS
    finally:
        read_only.close()
    assert store.register_buffer(4096, 4096) == mc.INVALID_PARAMS  # the unmapped first page
    buf = np.zeros(8192, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, 1 << 40) == mc.INVALID_PARAMS  # runs off
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0


def test_setup_failures_and_calls_before_setup() -> None:
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == mc.RPC_FAIL
    assert s.get("k") == b""
    assert s.is_exist("k") == mc.RPC_FAIL  # Mooncake: a negative ErrorCode, never 1 or 0
    assert s.batch_is_exist(["a", "b"]) == [mc.RPC_FAIL] * 2
    assert s.get_buffer("k") is None
    assert s.remove_all() == mc.RPC_FAIL
    assert s.get_batch(["a"]) == [b""]
    started = time.monotonic()
    dead = f"127.0.0.1:{_free_port()}"
    assert s.setup("h", "", 0, 0, "tcp", "", dead, timeout_s=0.5) in (mc.RPC_FAIL, mc.RPC_TIMEOUT)
    assert time.monotonic() - started < 3.0
    assert s.setup("h", "", 0, 0, "tcp", "", "not an address") == mc.INVALID_PARAMS
    assert s.setup("h", "", 0, 0, "carrier-pigeon", "", dead) == mc.INVALID_PARAMS
    assert s.close() == 0


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install kvpool[llm])")
def test_tensors(store: MooncakeDistributedStore) -> None:
    import torch

    t = torch.randn(3, 5, dtype=torch.float32)
    b = torch.arange(10, dtype=torch.bfloat16)
    assert store.put_tensor("compat/t", t) == 0
    assert torch.equal(store.get_tensor("compat/t"), t)
    assert store.batch_put_tensor(["compat/t1", "compat/t2"], [t, b]) == [0, 0]
    got = store.batch_get_tensor(["compat/t1", "compat/t2", "compat/none"])
    assert torch.equal(got[0], t)
    assert got[1].dtype == torch.bfloat16
    assert torch.equal(got[1], b)
    assert got[2] is None
    store.put("compat/raw", b"not a tensor")
    assert store.get_tensor("compat/raw") is None


def test_replica_descriptors_name_the_nodes_and_tier_that_hold_a_key(cluster: LocalCluster) -> None:
    """``get_replica_desc`` / ``batch_get_replica_desc``, as vLLM's MooncakeStoreConnector reads
    them to log which tier its loads came from: one COMPLETE descriptor per live replica, a
    memory replica while a node holds it in memory; missing keys left out, as Mooncake does."""
    s = MooncakeDistributedStore()
    assert _setup(s, cluster) == 0
    try:
        two = ReplicateConfig()
        two.replica_num = 2
        assert s.put("compat/rd-1", b"x" * 5000) == 0
        assert s.put("compat/rd-2", b"y" * 700, two) == 0
        found = s.batch_get_replica_desc(["compat/rd-1", "compat/rd-absent", "compat/rd-2"])
        assert sorted(found) == ["compat/rd-1", "compat/rd-2"]
        (one,) = found["compat/rd-1"]
        assert one.status == mc.ReplicaStatus.COMPLETE
        assert one.is_memory_replica()
        assert not one.is_disk_replica()
        assert not one.is_local_disk_replica()
        buffer = one.get_memory_descriptor().buffer_descriptor
        assert (buffer.size, buffer.buffer_address) == (5000, 0)
        with Client(cluster.client_master_addresses, timeout_s=5.0) as kv:
            where = kv.locate(["mooncake/default/compat/rd-2", "mooncake/default/compat/rd-1"])
            assert kv.locate(["mooncake/default/compat/rd-absent"]) == [None]
        assert where[0] is not None
        assert where[1] is not None
        # a fresh block: no node has reported a tier change yet (puts land in CPU memory)
        assert (where[0].size_bytes, where[0].tier, len(where[0].replicas)) == (700, "", 2)
        nodes = {m.data_address for m in where[0].replicas}
        assert len(nodes) == 2
        assert buffer.transport_endpoint == where[1].replicas[0].data_address
        with pytest.raises(TypeError, match="no disk descriptor"):
            one.get_disk_descriptor()
        pair = found["compat/rd-2"]
        assert len(pair) == 2
        endpoints = {d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in pair}
        assert endpoints == nodes  # two replicas on the cluster's two nodes
        assert len(s.get_replica_desc("compat/rd-2")) == 2
        assert s.get_replica_desc("compat/rd-absent") == []
    finally:
        s.close()
    assert s.batch_get_replica_desc(["compat/rd-1"]) == {}  # closed: nothing, as on error
