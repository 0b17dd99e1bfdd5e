"""``kvpool-bench engines``: stores measured inside SGLang's own HiCache storage code.

Three systems on the same workload, interleaved in one run, on SGLang's real host KV pool
(``MHATokenToKVPoolHost``, ``page_first``, bf16, 32 layers x 8 KV heads x 128: 128 KiB of K and V
per token, Llama-3-8B's geometry) on the CPU:

* ``mooncake`` — SGLang's own Mooncake backend (``MooncakeStore``) on a real Mooncake Store
  (``mooncake_master`` and one store process contributing the memory; the engine contributes
  none, as kvpool's clients hold none), over Mooncake's TCP transport;
* ``kvpool-mooncake-api`` — the same SGLang ``MooncakeStore`` code with ``mooncake.store`` being
  :mod:`kvpool.compat.mooncake`, on a local kvpool cluster;
* ``kvpool-native-tcp`` / ``kvpool-native-shm`` — :class:`kvpool.integrations.sglang.
  KVPoolHiCacheStorage` on the same cluster, its client over TCP / over the node's shared memory;
* ``kvpool-native-tcp-busy-poll`` (only when ``--systems`` names it) — the same over TCP with
  the client setting ``busy_poll_us`` (``--busy-poll-us``, 500): a lookup's or a read's answer
  awaited by spinning rather than sleeping.

Per page size and round, every system in turn (the order rotates) does what SGLang's cache
controller does with a batch of 128 pages: ``batch_set_v1`` (write back), ``batch_exists``
(the prefetch hit query), ``batch_get_v1`` (prefetch into other host pages). Every page read is
compared with the page that was set; the keys are removed after each round (not timed).
Reported: medians over the rounds, pages/s for set and get, microseconds per batch_exists (each
round's figure the median of :data:`EXISTS_CALLS` calls), and
each system's ratio to ``mooncake``. Needs SGLang (run it in .venv-sglang, which
``make test-engines-sglang`` builds) and, for the ``mooncake`` system, Mooncake Store's wheel
(installed there; elsewhere kvpool-bench's ``peers`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYERS, HEADS, HEAD_DIM, ITEMSIZE = 32, 8, 128, 2
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * ITEMSIZE  # K and V of one token: 128 KiB
DEFAULT_SIZES = "256KiB,1MiB,4MiB,8MiB"
SYSTEMS = ("mooncake", "kvpool-mooncake-api", "kvpool-native-tcp", "kvpool-native-shm")
"""Measured unless ``--systems`` says otherwise."""
KNOWN_SYSTEMS = (*SYSTEMS, "kvpool-native-tcp-busy-poll")
EXISTS_CALLS = 21
"""batch_exists calls per round (their median is the round's figure): the first few calls right
after a 128-page set measure what the set left running — for kvpool on one 2-core machine, its
three masters applying the commit on the cores the client needs (0.8-4 ms for the first call,
300-500 us from the third on) — not the hit query itself."""


@dataclass
class EnginesOptions:
    sizes: list[int]
    rounds: int = 5
    batch: int = 128
    systems: tuple[str, ...] = SYSTEMS
    masters: int = 3
    directory: str | None = None
    seed: int = 0
    busy_poll_us: int = 500  # kvpool-native-tcp-busy-poll's client setting


@dataclass
class System:
    """One store behind SGLang's storage interface, and how to drop a round's keys."""

    name: str
    backend: Any
    drop: Callable[[list[str]], None]
    info: dict[str, Any] = field(default_factory=dict)


def _parse_size(text: str) -> int:
    from kvpool.units import parse_size

    return int(parse_size(text))


@contextlib.contextmanager
def _mooncake_module(module: Any) -> Iterator[None]:
    """``mooncake.store`` is ``module`` while SGLang's MooncakeStore is built (it imports the
    store class in its constructor and keeps it)."""
    saved = {name: sys.modules.get(name) for name in ("mooncake", "mooncake.store")}
    sys.modules["mooncake.store"] = module
    if module.__name__ != "mooncake.store":
        sys.modules["mooncake"] = type(sys)("mooncake")
        sys.modules["mooncake"].store = module  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def _storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=None, extra_config=extra,
    )  # fmt: skip


def _host_pool(page_tokens: int, pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(
        page_tokens * 2, page_tokens, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
        start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info, 1.0, 0, page_tokens, "page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
        host_token_capacity=pages * page_tokens,
    )  # fmt: skip


def _mooncake_keys(keys: list[str]) -> list[str]:
    return [f"{k}_0_{c}" for k in keys for c in ("k", "v")]  # MooncakeStore's MHA keys, rank 0


def _sglang_mooncake(address: str, module: Any, pool: Any, name: str) -> System:
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    extra = {
        "master_server_address": address,
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": 0,  # the engine holds nothing; the store process does
    }
    with _mooncake_module(module):
        store = MooncakeStore(_storage_config(extra))
    store.register_mem_pool_host(pool)

    def drop(keys: list[str]) -> None:
        store.store.batch_remove(_mooncake_keys(keys), True)

    return System(name, store, drop)


def _native(masters: list[str], pool: Any, name: str, busy_poll_us: int) -> System:
    from kvpool.integrations.sglang import KVPoolHiCacheStorage

    transport = name.split("-")[2]  # kvpool-native-<transport>[-busy-poll]
    extra: dict[str, Any] = {
        "masters": masters, "interface_v1": 1, "transport": transport, "timeout_s": 10.0,
    }  # fmt: skip
    if name.endswith("-busy-poll"):
        extra["busy_poll_us"] = busy_poll_us
    backend = KVPoolHiCacheStorage(_storage_config(extra))
    backend.register_mem_pool_host(pool)
    scheme = backend._kv_scheme()

    def drop(keys: list[str]) -> None:
        backend._client.batch_remove(scheme.page_keys(keys))

    return System(name, backend, drop)


def _fill(pool: Any, seed: int) -> None:
    import numpy as np

    raw = pool.kv_buffer.reshape(-1).view(dtype=__import__("torch").uint8).numpy()
    rng = np.random.default_rng(seed)
    step = 64 << 20
    for at in range(0, raw.size, step):
        n = min(step, raw.size - at)
        raw[at : at + n] = rng.integers(0, 256, size=n, dtype=np.uint8)


def _indices(first_page: int, pages: int, page_tokens: int) -> Any:
    import torch

    return torch.arange(first_page * page_tokens, (first_page + pages) * page_tokens)


def _wrong_pages(pool: Any, batch: int, page_tokens: int) -> int:
    """Pages whose K or V in the read half differs from the written half."""
    import torch

    kv = pool.kv_buffer  # (2, tokens, layers, heads, dim)
    wrong = 0
    for p in range(batch):
        src = kv[:, p * page_tokens : (p + 1) * page_tokens]
        dst = kv[:, (batch + p) * page_tokens : (batch + p + 1) * page_tokens]
        wrong += not torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    return wrong


def _clear_read_half(pool: Any, batch: int, page_tokens: int) -> None:
    pool.kv_buffer[:, batch * page_tokens : 2 * batch * page_tokens].zero_()


def _round(system: System, pool: Any, batch: int, page_tokens: int) -> dict[str, Any]:
    keys = [uuid.uuid4().hex for _ in range(batch)]
    backend = system.backend
    _clear_read_half(pool, batch, page_tokens)
    t = time.perf_counter()
    stored = backend.batch_set_v1(keys, _indices(0, batch, page_tokens))
    set_s = time.perf_counter() - t
    exists: list[float] = []
    for _ in range(EXISTS_CALLS):
        t = time.perf_counter()
        hit = backend.batch_exists(keys)
        exists.append(time.perf_counter() - t)
    exists_s = statistics.median(exists)
    t = time.perf_counter()
    read = backend.batch_get_v1(keys, _indices(batch, batch, page_tokens))
    get_s = time.perf_counter() - t
    wrong = _wrong_pages(pool, batch, page_tokens)
    system.drop(keys)
    return {
        "set_pages_per_s": sum(stored) / set_s,
        "exists_us": exists_s * 1e6,
        "get_pages_per_s": sum(read) / get_s,
        "failed": (batch - sum(stored)) + (batch - hit) + (batch - sum(read)),
        "wrong": wrong,
    }


def run_engines(opts: EnginesOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    from kvpool.compat import mooncake as kvpool_mooncake
    from kvpool_bench.machine import round_trip_us
    from kvpool_bench.peer_servers import KvpoolServers, MooncakeServers, mooncake_availability

    root = Path(opts.directory or tempfile.mkdtemp(prefix="kvpool-bench-engines-"))
    biggest = max(opts.sizes) * opts.batch
    segment = max(1 << 30, 2 * biggest)
    systems = list(opts.systems)
    doc: dict[str, Any] = {
        "workload": {
            "pool": "SGLang MHATokenToKVPoolHost, page_first, bf16, 32 layers x 8 heads x 128",
            "batch_pages": opts.batch,
            "rounds": opts.rounds,
            "sizes": opts.sizes,
            "ops": "batch_set_v1, batch_exists, batch_get_v1 (SGLang's zero-copy calls)",
            **(
                {"busy_poll_us": opts.busy_poll_us}
                if "kvpool-native-tcp-busy-poll" in systems
                else {}
            ),
        },
        "systems": {},
        "results": {},
        "verification": {"pages_read": 0, "wrong": 0, "failed": 0},
    }
    kv = KvpoolServers(
        root / "kvpool", masters=opts.masters, nodes=1,
        cpu_cache_size=f"{max(2 << 30, 2 * biggest) >> 20}MiB", in_memory=True,
    )  # fmt: skip
    mc: MooncakeServers | None = None
    real_mooncake: Any = None
    if "mooncake" in systems:
        available = mooncake_availability()
        if available.ok:
            mc = MooncakeServers(root / "mooncake", segment_bytes=segment)
            real_mooncake = importlib.import_module("mooncake.store")
        else:
            systems.remove("mooncake")
            doc["systems"]["mooncake"] = {"status": f"skipped: {available.reason}"}
    try:
        kv.start()
        doc["systems"]["kvpool"] = {"status": "measured", **kv.info}
        if mc is not None:
            mc.start()
            doc["systems"]["mooncake"] = {"status": "measured", **mc.info}
        for size in opts.sizes:
            page_tokens = max(1, size // TOKEN_BYTES)
            label = f"{size >> 10}KiB" if size < 1 << 20 else f"{size >> 20}MiB"
            progress(f"page {label}: {page_tokens} tokens, host pool of {2 * opts.batch} pages")
            # The floor under every exists call, measured now: a request and its answer between
            # two Python processes on this host (bimodal on a 2-vCPU VM, by where they run).
            doc.setdefault("round_trip_floor", {})[label] = {
                k: round(v, 1) for k, v in round_trip_us(calls=1000).items()
            }
            pool = _host_pool(page_tokens, 2 * opts.batch)
            _fill(pool, opts.seed)
            built: list[System] = []
            for name in systems:
                if name == "mooncake":
                    built.append(_sglang_mooncake(mc.address, real_mooncake, pool, name))  # type: ignore[union-attr]
                elif name == "kvpool-mooncake-api":
                    address = ",".join(kv.masters)
                    built.append(_sglang_mooncake(address, kvpool_mooncake, pool, name))
                else:
                    built.append(_native(kv.masters, pool, name, opts.busy_poll_us))
            for s in built:  # warm-up: connections, registration, page faults
                _round(s, pool, min(opts.batch, 8), page_tokens)
            samples: dict[str, list[dict[str, Any]]] = {s.name: [] for s in built}
            for r in range(opts.rounds):
                for i in range(len(built)):
                    s = built[(r + i) % len(built)]
                    out = _round(s, pool, opts.batch, page_tokens)
                    samples[s.name].append(out)
                    doc["verification"]["pages_read"] += opts.batch
                    doc["verification"]["wrong"] += out["wrong"]
                    doc["verification"]["failed"] += out["failed"]
                progress(f"  round {r + 1}/{opts.rounds} done")
            doc["results"][label] = {
                name: {
                    m: round(statistics.median(x[m] for x in rows), 1)
                    for m in ("set_pages_per_s", "exists_us", "get_pages_per_s")
                }
                for name, rows in samples.items()
            }
            for s in built:
                with contextlib.suppress(Exception):
                    s.backend.close()
            del built, pool
    finally:
        kv.stop()
        if mc is not None:
            mc.stop()
    return doc


def _ratio(
    row: dict[str, Any], base: dict[str, Any] | None, metric: str, *, inverse: bool = False
) -> str:
    """This system's ``metric`` over mooncake's (``inverse``: mooncake's over this one's)."""
    if base is None or not base[metric] or not row[metric]:
        return "-"
    value = base[metric] / row[metric] if inverse else row[metric] / base[metric]
    return f"{value:.2f}"


def render_table(doc: dict[str, Any]) -> str:
    w = max([22, *(len(name) for by_system in doc["results"].values() for name in by_system)])
    lines = [
        "kvpool-bench engines: SGLang's storage calls, 128-page batches, medians over rounds",
        "",
        f"{'page':>7} {'system':<{w}} {'set pages/s':>12} {'x':>6} {'exists us':>10} {'x':>6} "
        f"{'get pages/s':>12} {'x':>6}",
    ]
    for label, by_system in doc["results"].items():
        base = by_system.get("mooncake")
        for name, r in by_system.items():
            set_x = _ratio(r, base, "set_pages_per_s")
            exists_x = _ratio(r, base, "exists_us", inverse=True)
            get_x = _ratio(r, base, "get_pages_per_s")
            lines.append(
                f"{label:>7} {name:<{w}} {r['set_pages_per_s']:>12.0f} {set_x:>6} "
                f"{r['exists_us']:>10.0f} {exists_x:>6} {r['get_pages_per_s']:>12.0f} {get_x:>6}"
            )
    v = doc["verification"]
    floor = doc.get("round_trip_floor", {})
    if floor:
        lines += [
            "",
            "round trip between two Python processes here, measured before each page size "
            "(64 B / 16 KiB request, p50 us): "
            + ", ".join(
                f"{label} {f['64B_p50_us']:.0f} / {f['16384B_p50_us']:.0f}"
                for label, f in floor.items()
            ),
        ]
    skipped = [
        f"{name}: {info['status']}"
        for name, info in doc.get("systems", {}).items()
        if isinstance(info, dict) and str(info.get("status", "")).startswith("skipped")
    ]
    if skipped:  # a system asked for but not measured: say so, not only leave its rows out
        lines += ["", *skipped]
    lines += [
        "",
        "x: ratio to mooncake (exists: mooncake's time over this one's; above 1 is faster)",
        f"pages read and compared: {v['pages_read']}, wrong: {v['wrong']}, failed: {v['failed']}",
    ]
    return "\n".join(lines)


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--sizes", default=DEFAULT_SIZES, help=f"page sizes [{DEFAULT_SIZES}]")
    b.add_argument("--rounds", type=int, default=5, help="interleaved rounds [5]")
    b.add_argument("--batch", type=int, default=128, help="pages per call [128, SGLang's]")
    b.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"any of {', '.join(KNOWN_SYSTEMS)} [{','.join(SYSTEMS)}]",
    )
    b.add_argument(
        "--busy-poll-us",
        type=int,
        default=500,
        help="the client setting busy_poll_us of kvpool-native-tcp-busy-poll [500]",
    )
    b.add_argument("--kvpool-masters", type=int, default=3, help="masters (Raft group) [3]")
    b.add_argument("--quick", action="store_true", help="256KiB,1MiB pages, 2 rounds of 32")
    b.add_argument("--dir", help="keep logs here [a temp dir]")
    b.add_argument("--json", metavar="PATH", help="also write every number as JSON to PATH")


def main_engines(args: argparse.Namespace) -> int:
    """0 measured with no wrong page; 1 a wrong page; 2 SGLang is not installed here."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        print(
            "kvpool-bench engines runs SGLang's own code: run it in the SGLang environment "
            "(make test-engines-sglang builds .venv-sglang; then "
            ".venv-sglang/bin/kvpool-bench engines)",
            file=sys.stderr,
        )
        return 2
    sizes = "256KiB,1MiB" if args.quick and args.sizes == DEFAULT_SIZES else args.sizes
    opts = EnginesOptions(
        sizes=[_parse_size(s) for s in sizes.split(",") if s.strip()],
        rounds=2 if args.quick else args.rounds,
        batch=32 if args.quick else args.batch,
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        masters=args.kvpool_masters,
        directory=args.dir,
        busy_poll_us=args.busy_poll_us,
    )
    unknown = [s for s in opts.systems if s not in KNOWN_SYSTEMS]
    if unknown:
        print(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(KNOWN_SYSTEMS)})")
        return 2
    doc = run_engines(opts, lambda line: print(line, file=sys.stderr, flush=True))
    print(render_table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if doc["verification"]["wrong"] == 0 else 1
