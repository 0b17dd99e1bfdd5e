"""kvpool.compat.mooncake.MooncakeDistributedStore: a script written for Mooncake Store runs
unchanged on kvpool (and, where Mooncake is installed, on Mooncake Store too), plus what the
compat layer adds: registered-buffer checks, error codes, replica counts, tensors."""

from __future__ import annotations

import ctypes
import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

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


def test_remove_all_removes_what_this_store_put(
    cluster: LocalCluster, store: MooncakeDistributedStore
) -> None:
    other = MooncakeDistributedStore()
    assert other.setup("h", "", 0, 0, "tcp", "", ",".join(cluster.client_master_addresses)) == 0
    try:
        assert other.put("compat/others", b"kept") == 0
        assert store.put_batch(["compat/mine-1", "compat/mine-2"], [b"1", b"2"]) == 0
        assert store.remove_all() >= 2
        assert store.batch_is_exist(["compat/mine-1", "compat/mine-2", "compat/others"]) == [
            0,
            0,
            1,
        ]
    finally:
        other.close()


def test_setup_failures_and_calls_before_setup() -> None:
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == mc.RPC_FAIL
    assert s.get("k") == b""
    assert s.is_exist("k") == -1
    assert s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.get_batch(["a"]) == [b""]
    started = time.monotonic()
    dead = f"127.0.0.1:{_free_port()}"
    assert s.setup("h", "", 0, 0, "tcp", "", dead, timeout_s=0.5) == mc.RPC_FAIL
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
