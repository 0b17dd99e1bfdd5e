"""kvpool as an LMCache remote-storage plugin, through LMCache's own code on CPU: its config
loader, ``CreateStorageBackends`` / ``CreateConnector``, its ``LocalCPUBackend`` (whose memory
objects reads land in) and ``RemoteBackend``, against a real kvpool cluster on 127.0.0.1; and
LMCache's own Mooncake connector (``mooncakestore://``), unchanged, on kvpool's Mooncake API.

Run by ``make test-engines-lmcache`` in its own environment (``.venv-lmcache``); skipped where
LMCache is not installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (make test-engines-lmcache)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import load_engine_config_with_overrides
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvpool.errors import ConfigError
from kvpool.launcher.cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)

CHUNK = 16
LAYERS, HEADS, HEAD = 2, 2, 64
TIMEOUT_S = 1.0
"""The deadline of the dead-store test; the others allow a loaded machine 5 s per call."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("lmcache-cluster"), masters=3, nodes=2,
                     cpu_cache_size="128MiB", in_memory=True)  # fmt: skip
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    try:
        yield lp
    finally:
        lp.call_soon_threadsafe(lp.stop)
        thread.join(5)


def yaml_config(tmp_path: Path, masters: str, timeout_s: float = 5.0, **extra: Any) -> Path:
    """The configuration docs/engines/lmcache.md gives, as a YAML file."""
    lines = [
        f"chunk_size: {CHUNK}",
        "local_cpu: true",
        "max_local_cpu_size: 0.2",
        'remote_storage_plugins: ["kvpool"]',
        f'remote_url: "kvpool://{masters}"',
        "extra_config:",
        "  remote_storage_plugin.kvpool.module_path: kvpool.integrations.lmcache",
        "  remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter",
        f"  remote_storage_plugin.kvpool.timeout_s: {timeout_s}",
    ]
    lines += [f"  remote_storage_plugin.kvpool.{k}: {v}" for k, v in extra.items()]
    path = tmp_path / f"lmcache-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def metadata(model: str = "test-model", heads: int = HEADS) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, heads, HEAD), chunk_size=CHUNK,
    )  # fmt: skip


class Engine:
    """One LMCache instance: its config, its CPU backend, and a connector made by LMCache."""

    def __init__(self, config_path: Path, loop: asyncio.AbstractEventLoop, **md: Any) -> None:
        self.config = load_engine_config_with_overrides(config_file_path=str(config_path))
        self.metadata = metadata(**md)
        self.loop = loop
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.connector = CreateConnector(
            self.config.remote_url, loop, self.cpu, self.config, self.metadata
        )

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def chunk(self, seed: int, tokens: int = CHUNK) -> Any:
        shape = torch.Size([2, LAYERS, tokens, HEADS * HEAD])
        obj = self.cpu.allocate([shape], [torch.bfloat16])
        g = torch.Generator().manual_seed(seed)
        values = torch.randn(shape, generator=g).to(torch.bfloat16)
        raw(obj)[:] = memoryview(values.view(torch.uint8).numpy()).cast("B")
        return obj

    def close(self) -> None:
        self.call(self.connector.close())
        self.cpu.close()


def raw(obj: Any) -> memoryview:
    """A memory object's bytes as a plain byte view (LMCache's is of format '<B')."""
    view: memoryview = memoryview(obj.byte_array)
    return view.cast("B") if view.format != "B" else view


def key(chunk_hash: int, model: str = "test-model") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, chunk_hash, torch.bfloat16)


def put(engine: Engine, k: CacheEngineKey, obj: Any) -> None:
    obj.ref_count_up()  # LMCache's RemoteBackend hands the connector its own reference
    engine.call(engine.connector.put(k, obj))


@pytest.fixture
def engines(
    cluster: LocalCluster, loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> Iterator[Any]:
    made: list[Engine] = []
    masters = ",".join(cluster.client_master_addresses)

    def make(**md: Any) -> Engine:
        engine = Engine(yaml_config(tmp_path, masters), loop, **md)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for e in made:
            e.close()


def test_chunks_put_by_one_instance_are_read_byte_exact_by_another(engines: Any) -> None:
    writer, reader = engines(), engines()
    assert type(writer.connector._connector).__name__ == "KVPoolRemoteConnector"
    full, partial = writer.chunk(1), writer.chunk(2, tokens=5)
    k_full, k_partial, k_absent = key(101), key(102), key(103)
    put(writer, k_full, full)
    put(writer, k_partial, partial)

    assert reader.call(reader.connector.exists(k_full))
    assert reader.connector.exists_sync(k_partial)
    assert not reader.call(reader.connector.exists(k_absent))

    got = reader.call(reader.connector.get(k_full))
    assert bytes(raw(got)) == bytes(raw(full))
    assert got.get_shapes() == [torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])]
    got_partial = reader.call(reader.connector.get(k_partial))
    assert got_partial.get_shape() == torch.Size([2, LAYERS, 5, HEADS * HEAD])
    assert got_partial.get_shapes() == [got_partial.get_shape()]
    assert bytes(raw(got_partial)) == bytes(raw(partial))
    assert reader.call(reader.connector.get(k_absent)) is None
    for obj in (got, got_partial):
        obj.ref_count_down()


def test_batched_calls_and_prefix_contains(engines: Any) -> None:
    writer, reader = engines(), engines()
    keys = [key(200 + i) for i in range(6)]
    objs = [writer.chunk(10 + i) for i in range(6)]
    for obj in objs:
        obj.ref_count_up()
    writer.call(writer.connector.batched_put(keys[:4], objs[:4]))
    put(writer, keys[5], objs[5])  # 4 is missing: a gap

    assert reader.connector.batched_contains(keys) == 4
    assert reader.call(reader.connector.batched_async_contains("look", keys)) == 4
    got = reader.call(reader.connector.batched_get(keys))
    assert [g is not None for g in got] == [True, True, True, True, False, True]
    for g, obj in zip(got, objs, strict=True):
        if g is not None:
            assert bytes(raw(g)) == bytes(raw(obj))
            g.ref_count_down()
    leading = reader.call(reader.connector.batched_get_non_blocking("look", keys))
    assert len(leading) == 4
    for g in leading:
        g.ref_count_down()

    assert reader.connector.remove_sync(keys[0])
    assert reader.connector.batched_contains(keys) == 0
    assert reader.call(reader.connector.ping()) == 0


def test_another_format_never_reads_these_chunks(engines: Any) -> None:
    writer = engines()
    other = engines(heads=1)  # another KV shape, the same LMCache key
    put(writer, key(300), writer.chunk(3))
    assert writer.connector.exists_sync(key(300))
    assert not other.connector.exists_sync(key(300))
    assert other.call(other.connector.get(key(300))) is None


def test_lmcaches_own_backends_use_the_plugin_once(
    cluster: LocalCluster, loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    masters = ",".join(cluster.client_master_addresses)
    config = load_engine_config_with_overrides(config_file_path=str(yaml_config(tmp_path, masters)))
    md = metadata()
    backends = CreateStorageBackends(config, md, loop, dst_device="cpu")
    try:
        remote = backends["RemoteBackend-kvpool"]
        legacy = backends["RemoteBackend"]  # the one LMCache makes for remote_url
        assert not remote.connection._connector.standing_aside
        assert legacy.connection._connector.standing_aside
        cpu = backends["LocalCPUBackend"]
        shape = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])
        obj = cpu.allocate([shape], [torch.bfloat16])
        raw(obj)[:] = os.urandom(len(raw(obj)))
        k = key(400)
        remote.submit_put_task(k, obj).result(10)
        assert remote.contains(k)
        assert not legacy.contains(k)  # it stands aside: no chunk is written or read twice
        got = remote.get_blocking(k)
        assert bytes(raw(got)) == bytes(raw(obj))
        got.ref_count_down()
    finally:
        for backend in backends.values():
            backend.close()


def test_a_dead_store_is_a_miss_within_the_deadline(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    c = LocalCluster(
        tmp_path / "doomed", masters=1, nodes=1, cpu_cache_size="64MiB", in_memory=True
    )
    try:
        c.start()
        config = yaml_config(tmp_path, ",".join(c.client_master_addresses), timeout_s=TIMEOUT_S)
        engine = Engine(config, loop)
        try:
            put(engine, key(500), engine.chunk(5))
            assert engine.connector.exists_sync(key(500))
            for name in c.node_names:
                c.kill(name)
            started = time.monotonic()
            assert engine.call(engine.connector.get(key(500))) is None
            assert time.monotonic() - started < 3 * TIMEOUT_S + 1
            for name in c.master_names:
                c.kill(name)
            started = time.monotonic()
            assert not engine.connector.exists_sync(key(500))
            assert engine.connector.batched_contains([key(500)]) == 0
            assert engine.call(engine.connector.get(key(500))) is None
            put(engine, key(501), engine.chunk(6))  # no exception into LMCache
            assert engine.call(engine.connector.ping()) == 1
            assert time.monotonic() - started < 6 * (TIMEOUT_S + 1)
        finally:
            engine.close()
    finally:
        c.stop()


def test_a_dead_store_is_left_alone_for_retry_after_s(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A connector made while no master answers waits one deadline (its warm-up), and while the
    store is left alone (``retry_after_s``) presence queries miss and puts are dropped at once
    instead of each waiting out the deadline; after that the store is asked again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    config = yaml_config(tmp_path, dead, timeout_s=TIMEOUT_S, retry_after_s=1.5)
    engine = Engine(config, loop)
    built = time.monotonic()
    try:
        asked = time.monotonic()
        assert not engine.connector.exists_sync(key(700))
        assert engine.connector.batched_contains([key(700), key(701)]) == 0
        put(engine, key(702), engine.chunk(7))
        assert time.monotonic() - asked < 0.3
        time.sleep(max(0.0, built + 1.6 - time.monotonic()))
        asked = time.monotonic()
        assert not engine.connector.exists_sync(key(700))
        assert time.monotonic() - asked >= 0.9 * TIMEOUT_S  # asked again: the deadline
    finally:
        engine.close()


def test_bad_settings_are_refused_by_name(
    cluster: LocalCluster, loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    from kvpool.integrations.lmcache import lmcache_settings

    masters = ",".join(cluster.client_master_addresses)
    config = load_engine_config_with_overrides(
        config_file_path=str(yaml_config(tmp_path, masters, mastrs="h:1"))
    )
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.kvpool\..*'mastrs'.*unknown"):
        lmcache_settings(config.remote_url, config)
    config = load_engine_config_with_overrides(
        config_file_path=str(yaml_config(tmp_path, masters, timeout_s="soon"))  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=r"'timeout_s'.*seconds"):
        lmcache_settings("plugin://kvpool", config)
    bare = load_engine_config_with_overrides(overrides={"chunk_size": CHUNK})
    with pytest.raises(ConfigError, match="no kvpool masters"):
        lmcache_settings("plugin://kvpool", bare)


# --- LMCache's own Mooncake connector on kvpool's Mooncake API ----------------------------------

SHIM = Path(__file__).parents[1] / "sglang" / "shim"
"""A ``mooncake`` package whose ``store`` is :mod:`kvpool.compat.mooncake` (docs/mooncake.md)."""


@pytest.fixture(scope="module")
def mooncake_shim() -> Iterator[None]:
    """``import mooncake.store`` finds kvpool's Mooncake API, as ``PYTHONPATH=<shim>`` does for
    a user; LMCache's ``MooncakestoreConnector`` imports it when it is created."""
    sys.path.insert(0, str(SHIM))
    try:
        import mooncake.store

        assert Path(mooncake.store.__file__).is_relative_to(SHIM), mooncake.store.__file__
        yield
    finally:
        sys.path.remove(str(SHIM))
        for name in ("mooncake.store", "mooncake"):
            sys.modules.pop(name, None)


def mooncake_yaml(tmp_path: Path, masters: str, **extra: Any) -> Path:
    """LMCache's Mooncake connector configured as LMCache documents it, with
    ``master_server_address`` naming the kvpool masters (or ``mooncake_<setting>`` names)."""
    lines = [
        f"chunk_size: {CHUNK}",
        "local_cpu: true",
        "max_local_cpu_size: 0.2",
        f'remote_url: "mooncakestore://{masters.split(",", maxsplit=1)[0]}"',
        "extra_config:",
        '  local_hostname: "127.0.0.1"',
        '  metadata_server: "P2PHANDSHAKE"',
        '  protocol: "tcp"',
        "  transfer_timeout: 5",
    ]
    if not any(k.endswith("master_server_addr") for k in extra):
        lines.append(f'  master_server_address: "{masters}"')
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    path = tmp_path / f"mooncake-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def mooncake_engines(
    cluster: LocalCluster,
    loop: asyncio.AbstractEventLoop,
    tmp_path: Path,
    mooncake_shim: None,
) -> Iterator[Any]:
    made: list[Engine] = []
    masters = ",".join(cluster.client_master_addresses)

    def make(current_names: bool = False, **extra: Any) -> Engine:
        if current_names:  # Mooncake's current name for the master, through LMCache's prefix
            extra["mooncake_master_server_addr"] = f'"{masters}"'
        engine = Engine(mooncake_yaml(tmp_path, masters, **extra), loop)
        assert type(engine.connector._connector).__name__ == "MooncakestoreConnector"
        assert type(engine.connector._connector.store).__module__ == "kvpool.compat.mooncake"
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for e in made:
            e.close()


def test_lmcaches_mooncake_connector_with_its_defaults_runs_on_kvpool(
    mooncake_engines: Any,
) -> None:
    """Its defaults: ``save_chunk_meta`` on, so chunks are written with ``put_parts`` (LMCache's
    metadata, then the KV bytes) and read with ``batch_get_buffer``; ``is_exist`` for contains."""
    writer, reader = mooncake_engines(), mooncake_engines()
    assert writer.connector._connector.save_chunk_meta
    keys = [key(400 + i, model="mc-model") for i in range(4)]
    objs = [writer.chunk(40 + i) for i in range(3)] + [writer.chunk(43, tokens=5)]
    for k, obj in zip(keys[:2] + keys[3:], objs[:2] + objs[3:], strict=True):
        put(writer, k, obj)  # key 2 is missing: a gap

    assert reader.call(reader.connector.exists(keys[0]))
    assert not reader.connector.exists_sync(keys[2])
    assert reader.call(reader.connector.batched_async_contains("look", keys)) == 2
    got = reader.call(reader.connector.batched_get(keys))
    assert [g is not None for g in got] == [True, True, False, True]
    for g, obj in zip(got, objs, strict=True):
        if g is not None:
            assert g.get_shapes() == obj.get_shapes()
            assert bytes(raw(g)) == bytes(raw(obj))
            g.ref_count_down()


def test_lmcaches_mooncake_connector_zero_copy_mode_runs_on_kvpool(
    mooncake_engines: Any,
) -> None:
    """``save_chunk_meta: false``: LMCache registers its CPU pool (``register_buffer``), writes
    with ``batch_put_from`` / ``put_from`` and reads with ``batch_get_into`` into its memory
    objects; the master named by Mooncake's current setting name (``mooncake_`` prefixed)."""
    writer = mooncake_engines(current_names=True, save_chunk_meta="false")
    reader = mooncake_engines(current_names=True, save_chunk_meta="false")
    assert not writer.connector._connector.save_chunk_meta
    keys = [key(500 + i, model="mc-zero-copy") for i in range(3)]
    objs = [writer.chunk(50 + i) for i in range(3)]
    for obj in objs:
        obj.ref_count_up()
    writer.call(writer.connector.batched_put(keys[:2], objs[:2]))
    put(writer, keys[2], objs[2])
    got = reader.call(reader.connector.batched_get([*keys, key(599, model="mc-zero-copy")]))
    assert [g is not None for g in got] == [True, True, True, False]
    for g, obj in zip(got, objs, strict=False):
        assert g is not None
        assert bytes(raw(g)) == bytes(raw(obj))
        g.ref_count_down()
