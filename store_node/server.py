"""The store node process (`kvpool node`): tiers, data server, admin service, registration.

``main(cfg)`` blocks until SIGTERM or SIGINT and returns the exit status: 0 after a graceful
stop, 2 when the configuration or start-up is refused (the reason on stderr), 1 when the node
failed while running (for example the masters speak another protocol version).

Lifecycle: CPU arena, SSD tier (refused at start when larger than the free disk; its blocks
recovered and verified: ``ssd_tier_recovered``), GPU tier (or ``gpu_tier_unavailable`` with the
reason, and the node goes on with CPU and SSD), block store and tier worker → data server →
admin server (not ready) → ``node_started`` → register (retried until a leader answers) → ready,
ready file, ``node_registered`` → SSD blocks claimed back, heartbeats, eviction and tier
reports, staged reaper → signal → LeaveNode → stop accepting → close servers → tier work
drained → release the tiers → ``node_stopped``.

``python -m kvpool.store_node.server --config-json '{"masters": [...]}'`` runs one node without
the ``kvpool`` command (tests, debugging).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvpool.config import NodeConfig, load_config, split_hostport
from kvpool.errors import ConfigError, KVPoolError
from kvpool.gctune import freeze_after_slow_collections
from kvpool.grpcutil import start_server
from kvpool.logs import bind_process, configure_logging, get_logger
from kvpool.mastercall import MasterClient
from kvpool.metrics import register_collector, start_metrics
from kvpool.proto.v1 import node_pb2_grpc
from kvpool.store_node.admin import SERVICE_NAME, NodeAdmin
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import POLICIES, make_policy
from kvpool.store_node.node_metrics import node_families
from kvpool.store_node.publish_check import IndexVersions
from kvpool.store_node.registration import NodeRegistration
from kvpool.store_node.tier_worker import TierWorker
from kvpool.store_node.tiers import Tier
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.store_node.tiers.gpu import GpuTier, GpuUnavailableError
from kvpool.store_node.tiers.ssd import SsdTier, SsdTierError
from kvpool.store_node.warm_restart import recover_ssd, restore_into
from kvpool.tracing import setup_tracing

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
ADMIN_STOP_GRACE_S = 1.0
STOP_GRACE_S = 1.0
"""How long background work may take to wind down after SIGTERM before it is cancelled."""


class StartupError(Exception):
    """The node cannot start; the message says why (exit status 2)."""


def check_config(cfg: NodeConfig) -> list[str]:
    """Every reason to refuse ``cfg``, each naming its setting (empty when fine)."""
    problems = cfg.validate()
    if cfg.eviction_policy and cfg.eviction_policy not in POLICIES:
        problems.append(
            f"eviction_policy: unknown policy {cfg.eviction_policy!r} "
            f"(known: {', '.join(sorted(POLICIES))})"
        )
    if not cfg.advertise_host:
        for name in ("listen", "data_listen"):
            try:
                host, _ = split_hostport(getattr(cfg, name))
            except ValueError:
                continue  # already reported by validate()
            if host in WILDCARD_HOSTS:
                problems.append(
                    f"advertise_host: required when {name} binds every interface ({host}); "
                    "set the address clients and masters should dial"
                )
    return problems


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_ready_file(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True) + "\n")
    os.replace(tmp, target)


async def serve(cfg: NodeConfig, stop: asyncio.Event | None = None) -> int:
    """Run the node until ``stop`` is set (or SIGTERM/SIGINT when run in the main thread).

    Raises StartupError when the arena or a listening address cannot be had.
    """
    log = get_logger("kvpool.node")
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # not the main thread (tests): the caller sets `stop`
    data_host, data_port = split_hostport(cfg.data_listen)
    admin_host, _ = split_hostport(cfg.listen)
    security = cfg.security()
    status = 0
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                tier = CpuTier(cfg.cpu_cache_size)
            except (OSError, ValueError) as e:
                raise StartupError(
                    f"cpu_cache_size: cannot map {cfg.cpu_cache_size} bytes: {e}"
                ) from e
            stack.callback(tier.close)
            ssd = _open_ssd(cfg, log)
            if ssd is not None:
                stack.callback(ssd.close)
            gpu = _open_gpu(cfg, log)
            if gpu is not None:
                stack.callback(gpu.close)
            store = BlockStore(
                tier,
                make_policy(cfg.eviction_policy),
                max_block_size=cfg.max_block_size,
                clock=time.monotonic,
                high_watermark=cfg.high_watermark,
                low_watermark=cfg.low_watermark,
                ssd=ssd,
                gpu=gpu,
                gpu_policy=make_policy(cfg.eviction_policy) if gpu is not None else None,
                promote_after_hits=cfg.promote_after_hits,
                gpu_promote_after_hits=cfg.gpu_promote_after_hits,
                write_batch_bytes=cfg.ssd_write_batch_size,
                max_receiving_bytes=int(cfg.put_memory_fraction * tier.capacity_bytes),
            )
            worker = TierWorker(store, read_threads=cfg.tier_threads, log=log)
            recovered = []
            if ssd is not None:
                recovered = await _recover(ssd, store, log)
            worker.start()
            stack.push_async_callback(worker.stop)

            data = DataServer(
                store,
                log=log,
                worker=worker,
                lease_timeout_s=cfg.lease_timeout_s,
                shm=cfg.data_shm,
                shm_directory=cfg.data_shm_directory,
                token=security.token,
                limits=cfg.ingress_limits(),
            )
            try:
                port = await data.start(data_host, data_port)
            except OSError as e:
                raise StartupError(f"data_listen: cannot listen on {cfg.data_listen}: {e}") from e
            stack.push_async_callback(data.close)
            data_address = cfg.advertise_data_address or (
                f"tcp://{join_hostport(cfg.advertise_host or data_host, port)}"
            )

            masters = MasterClient(
                cfg.masters,
                attempt_timeout_s=min(1.0, cfg.request_timeout_s),
                security=security,
            )
            stack.push_async_callback(masters.close)
            # Short: a put replacing a block on this node waits for its PUBLISH's answer.
            versions = IndexVersions(masters, timeout_s=min(1.0, cfg.request_timeout_s), log=log)
            stack.push_async_callback(versions.close)
            data.versions = versions  # PUBLISH versions from the index, never from frames
            registration = NodeRegistration(
                cfg,
                store,
                masters,
                data_address=data_address,
                admin_address="",
                on_receipt_key=versions.learn_key,
                log=log,
            )
            registration.restore_after_start(recovered)
            admin = NodeAdmin(store, registration, logger=log, token=security.token)
            stack.push_async_callback(admin.close)
            try:
                handle = await start_server(
                    cfg.listen,
                    [(node_pb2_grpc.add_NodeAdminServicer_to_server, admin, SERVICE_NAME)],
                    security=security,
                    max_receive_bytes=cfg.max_request_size,
                    max_connections=cfg.max_connections,
                )
            except (KVPoolError, RuntimeError, OSError) as e:
                raise StartupError(f"listen: cannot serve gRPC on {cfg.listen}: {e}") from e
            stack.push_async_callback(handle.stop, ADMIN_STOP_GRACE_S)
            admin_address = join_hostport(cfg.advertise_host or admin_host, handle.port)
            metrics_address = await _start_metrics(cfg, admin_host, store, registration, stack)
            registration.admin_address = admin_address
            log.info(
                "node_started",
                data=data_address,
                shm=data.shm_address or None,
                admin=admin_address,
                capacity_bytes=tier.capacity_bytes,
                tiers={t.name: t.capacity_bytes for t in store.tier_stats()},
                eviction_policy=cfg.eviction_policy,
                masters=list(cfg.masters),
                pid=os.getpid(),
            )

            async def registered(member_id: int, first: bool) -> None:
                await handle.set_ready(True)
                if cfg.ready_file:
                    write_ready_file(
                        cfg.ready_file,
                        {
                            "role": "node",
                            "pid": os.getpid(),
                            "node_id": cfg.resolved_node_id,
                            "member_id": member_id,
                            "admin": admin_address,
                            "data": data_address,
                            "metrics": metrics_address,
                        },
                    )
                if first:
                    log.info(
                        "node_registered",
                        member_id=member_id,
                        incarnation=registration.incarnation,
                        heartbeat_interval_s=registration.heartbeat_interval_s,
                    )

            async def drained() -> None:
                await handle.set_ready(False)  # left for good: not ready until a restart

            registration.on_registered = registered
            registration.on_drained = drained
            prefault_stop = threading.Event()
            prefault = asyncio.create_task(_prefault(tier, prefault_stop, log, cfg))
            status = await _run_until_stopped(registration, stop, log)

            await handle.set_ready(False)
            await registration.leave()
            data.stop_accepting()
            prefault_stop.set()
            await prefault
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    log.info("node_stopped", status=status)
    return status


async def _start_metrics(
    cfg: NodeConfig,
    host: str,
    store: BlockStore,
    registration: NodeRegistration,
    stack: contextlib.AsyncExitStack,
) -> str:
    """``/metrics`` on the admin host (``metrics_port``); its address, "" when off."""
    try:
        server = await start_metrics(host, cfg.metrics_port, "node")
    except OSError as e:
        raise StartupError(f"metrics_port: cannot listen on {host}: {e}") from e
    if server is None:
        return ""
    stack.push_async_callback(server.close)
    stack.callback(
        register_collector(lambda: node_families(store, registered=registration.member_id != 0))
    )
    return join_hostport(host, server.port)


def _open_ssd(cfg: NodeConfig, log: Any) -> SsdTier | None:
    if not cfg.ssd_cache_size:
        return None
    try:
        ssd = SsdTier(
            cfg.ssd_cache_path,
            cfg.ssd_cache_size,
            cfg.ssd_segment_size,
            direct_io=cfg.ssd_direct_io,
        )
    except SsdTierError as e:
        raise StartupError(str(e)) from e
    log.info(
        "ssd_tier_opened",
        path=str(ssd.data_path),
        capacity_bytes=ssd.capacity_bytes,
        segments=ssd.segments.segment_count,
        direct_io=ssd.direct_io,
        io=ssd.direct_reason,
    )
    if not ssd.direct_io and cfg.ssd_direct_io:
        log.warning("ssd_direct_io_unavailable", reason=ssd.direct_reason)
    return ssd


def _open_gpu(cfg: NodeConfig, log: Any) -> Tier | None:
    if not cfg.gpu_cache_size:
        return None
    try:
        gpu = GpuTier(cfg.gpu_cache_size, device=cfg.gpu_device)
    except GpuUnavailableError as e:
        log.warning("gpu_tier_unavailable", reason=str(e), tiers="cpu and ssd only")
        return None
    log.info("gpu_tier_opened", device=cfg.gpu_device, capacity_bytes=gpu.capacity_bytes)
    return gpu


async def _recover(ssd: SsdTier, store: BlockStore, log: Any) -> list[tuple[str, int]]:
    """Find the SSD tier's blocks again (verified) and put them in the store."""
    recovery = await asyncio.to_thread(recover_ssd, ssd)
    held = restore_into(store, recovery)
    if not recovery.layout_ok:
        log.warning("ssd_tier_reset", reason="its files were written for another size or layout")
    log.info(
        "ssd_tier_recovered",
        blocks=held,
        corrupt=recovery.corrupt,
        torn_manifest_bytes=recovery.torn_bytes,
        verified_bytes=recovery.verified_bytes,
        seconds=round(recovery.seconds, 3),
    )
    return [b.id for b in store.committed_blocks()]


async def _prefault(tier: CpuTier, stop: threading.Event, log: Any, cfg: NodeConfig) -> None:
    if not cfg.cpu_tier_prefault:
        return
    started = time.monotonic()
    done = await asyncio.to_thread(tier.prefault, stop)
    log.info(
        "tier_prefaulted",
        tier=tier.name,
        bytes=done,
        complete=done >= tier.capacity_bytes,
        seconds=round(time.monotonic() - started, 3),
    )


async def _run_until_stopped(registration: NodeRegistration, stop: asyncio.Event, log: Any) -> int:
    work = asyncio.create_task(registration.run(stop), name="node-registration")
    stopped = asyncio.create_task(stop.wait(), name="node-stop")
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        stopped.cancel()
    try:
        # The loops notice `stop` between rounds; a master call in flight is cut short.
        await asyncio.wait_for(asyncio.shield(work), STOP_GRACE_S)
    except TimeoutError:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
    except KVPoolError as e:
        log.error("node_failed", error=e.message, code=e.code)
        return 1
    except Exception:
        log.exception("node_failed")
        return 1
    return 0


def main(cfg: NodeConfig) -> int:
    """Run a store node until SIGTERM/SIGINT; returns the process exit status."""
    try:
        configure_logging(cfg.log_level, cfg.log_format)
    except ValueError as e:
        print(f"kvpool node: invalid configuration:\n  {e}", file=sys.stderr)
        return 2
    bind_process(role="node", node_id=cfg.resolved_node_id)
    problems = check_config(cfg)
    if problems:
        print("kvpool node: invalid configuration:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    setup_tracing("node")
    log = get_logger("kvpool.node")
    freeze_after_slow_collections(
        on_freeze=lambda ms, frozen: log.info(
            "gc_frozen", full_collection_ms=round(ms, 1), frozen=frozen
        )
    )
    try:
        return asyncio.run(serve(cfg))
    except StartupError as e:
        get_logger("kvpool.node").error("node_start_failed", error=str(e))
        print(f"kvpool node: {e}", file=sys.stderr)
        return 2


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.store_node.server", description="Run one kvpool store node."
    )
    parser.add_argument("--config", help="TOML file (settings under [node])")
    parser.add_argument("--config-json", help='settings as a JSON object: {"masters": [...]}')
    args = parser.parse_args(argv)
    try:
        overrides = json.loads(args.config_json) if args.config_json else {}
        if not isinstance(overrides, dict):
            raise ConfigError("--config-json: expected a JSON object")
        cfg = load_config(NodeConfig, toml_path=args.config, section="node", overrides=overrides)
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"kvpool node: {e}", file=sys.stderr)
        return 2
    return main(cfg)


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
