"""The ``kvpool-bench`` command: kvpool's benchmarks, each measured the same way every time.

    kvpool-bench cluster | index | data-plane | tiers | peers | engines | client
    kvpool-bench replicas | tracing

They start what they measure (a local cluster, Redis, Mooncake Store, ...) on 127.0.0.1. The
machine may be noisy: compare numbers from one run. Exit codes: 0 done, 1 a wrong read or a
failure at run time, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool.cli.args import exit_status, parse_forwarding
from kvpool.cli.bench import print_result
from kvpool_bench.engines import add_arguments as engines_arguments

EXIT_OK = 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-bench",
        description="kvpool's benchmarks. The machine may be noisy: compare numbers from one run.",
    )
    bsub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    b = bsub.add_parser(
        "cluster",
        help="a local cluster: put/get p50 at 4 KiB and 1 MiB, batches, failover time",
    )
    b.add_argument("--rounds", type=int, default=200, help="interleaved rounds per size [200]")
    b.add_argument("--kills", type=int, default=3, help="leader kills to time failover [3]")
    b.add_argument(
        "--pauses", type=int, default=0, help="leader SIGSTOPs to time failover, as --kills [0]"
    )
    b.add_argument("--dir", help="keep the cluster's data and logs here [a temp dir]")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser(
        "tracing",
        help="get throughput with tracing on and off (interleaved), the trace of one get",
    )
    b.add_argument("--rounds", type=int, default=7, help="rounds per mode [7]")
    b.add_argument("--gets", type=int, default=2000, help="4 KiB gets per round [2000]")
    b.add_argument("--dir", help="keep the cluster's data and logs here [a temp dir]")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser(
        "replicas",
        help="hot-block replication time, repair time after a node kill, hit rate through a "
        "node kill with and without hot replicas",
    )
    b.add_argument("--blocks", type=int, default=10_000, help="blocks to repair [10000]")
    b.add_argument("--block-size", type=int, default=4096, help="bytes per block [4096]")
    b.add_argument("--rounds", type=int, default=5, help="hot blocks timed [5]")
    b.add_argument("--window", type=float, default=10.0, help="seconds read after the kill [10]")
    b.add_argument("--quick", action="store_true", help="small sizes (seconds, for smoke runs)")
    b.add_argument("--dir", help="keep the clusters' data and logs here [a temp dir]")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser(
        "index",
        help="the master: memory per 1 M entries, apply rate, compaction stall, commit rates",
    )
    b.add_argument("--quick", action="store_true", help="small sizes (seconds, for smoke runs)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser(
        "tiers",
        help="the tiered node: write flood (demotions, evictions), CPU vs SSD get GB/s, "
        "eviction decisions/s, warm-restart time",
    )
    b.add_argument("--quick", action="store_true", help="small sizes (seconds, for smoke runs)")
    b.add_argument("--dir", help="where the SSD tier's files go [a temp dir]")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser(
        "peers",
        help="kvpool vs Redis vs Mooncake Store vs the machine's limits (memcpy, loopback "
        "TCP): GB/s, keys/s, p50, p99, ratios",
        description="Start a local kvpool cluster, Redis (redis-server, persistence off) and "
        "Mooncake Store (mooncake_master + one store process) on 127.0.0.1; run puts and gets "
        "of 4 KiB to 16 MiB, one key per call and batched (and, with --modes first-read, "
        "first reads: one process puts, another reads each block once; hand-off: another "
        "process reads each block the moment its put returned; engine: presence query then "
        "read of the hits per batch), from 1 and 2 client processes, "
        "every system in turn at every size, for several rounds; compare every byte read with "
        "what was put; print medians and ratios. Peers that are not installed are skipped: "
        "pip install -e 'bench[peers]' and apt-get install redis-server libibverbs1.",
    )
    b.add_argument("--quick", action="store_true", help="a smoke run of seconds (CI)")
    b.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write every number as JSON to PATH (no PATH: print JSON instead of the table)",
    )
    b.add_argument("--markdown", metavar="PATH", help="also write the tables as Markdown")
    b.add_argument("--sizes", help="block sizes [4KiB,64KiB,1MiB,4MiB,16MiB; quick 4KiB,1MiB]")
    b.add_argument("--rounds", type=int, help="interleaved rounds, medians over them [5; quick 1]")
    b.add_argument("--clients", help="client process counts [1,2]")
    b.add_argument(
        "--modes",
        help="single,batch,first-read,hand-off,engine [single,batch]: one key per call, "
        "batched (each client reads back its own keys); first read (one process puts, another "
        "reads each block once); hand-off (one process puts a block, another reads it the "
        "moment the put returned: misses, p50/p99 latency); engine (another process's batch "
        "of --engine-batch keys: a presence query, then a read of the hits, as SGLang and "
        "LMCache call a store). hand-off and engine always run one writer and one reader",
    )
    b.add_argument(
        "--engine-batch",
        type=int,
        metavar="KEYS",
        help="keys per batch in the engine mode [128; fewer where a batch would pass 128 MiB "
        "or the arena: 128 x 1 MiB needs --arena 128MiB]",
    )
    b.add_argument(
        "--arena",
        metavar="SIZE",
        help="each client process's buffer: the blocks it puts and the buffers it reads into; "
        "one pass of a cell holds at most this much [64MiB; quick 8MiB]",
    )
    b.add_argument("--peers", help="redis,mooncake [both]; none: kvpool and the limits only")
    b.add_argument(
        "--gc-freeze",
        action="store_true",
        help="the client processes (every client measured) freeze what survives a slow full "
        "garbage collection (kvpool.gctune), as an engine may",
    )
    b.add_argument("--kvpool-masters", type=int, default=3, help="masters (Raft group) [3]")
    b.add_argument("--kvpool-nodes", type=int, default=1, help="store nodes [1]")
    b.add_argument(
        "--kvpool-transports",
        help="Client(transport=...) values, each measured as kvpool-NAME "
        "[tcp,shm when the client takes transport=]",
    )
    b.add_argument(
        "--kvpool-api",
        choices=("auto", "sync", "async", "both"),
        default="auto",
        help="which client: kvpool.Client (sync), kvpool.AsyncClient (async, measured as "
        "kvpool-...-async) or both on every transport [auto: Client on every transport and "
        "AsyncClient on the first, when there is one]",
    )
    b.add_argument(
        "--kvpool-busy-poll-us",
        type=int,
        default=0,
        metavar="US",
        help="also measure every kvpool.Client with the client setting busy_poll_us=US, as "
        "kvpool-...-busy-poll [0: not]",
    )
    b.add_argument(
        "--kvpool-in-memory", action="store_true", help="masters keep the index in memory only"
    )
    b.add_argument("--dir", help="keep logs and data here [a temp dir, removed]")
    b.add_argument("--seed", type=int, default=0, help="seed of the block contents [0]")
    b = bsub.add_parser(
        "engines",
        help="inside SGLang's HiCache code: its Mooncake backend on Mooncake Store and on "
        "kvpool's Mooncake API, and kvpool's native backend (run in .venv-sglang)",
        description="SGLang's real host KV pool on the CPU; 128-page batch_set_v1, "
        "batch_exists and batch_get_v1 through SGLang's Mooncake backend on Mooncake Store, the "
        "same code on kvpool's Mooncake API, and kvpool's native HiCache backend, interleaved "
        "in rounds; every page read compared with what was set; medians and ratios.",
    )
    engines_arguments(b)
    b = bsub.add_parser(
        "data-plane",
        help="one store node's data server over loopback TCP (PUT/GET p50 and MB/s)",
        add_help=False,
    )
    b.set_defaults(forward_unknown=True)  # its own flags: --sizes, --depths, --budget-mib ...
    b = bsub.add_parser(
        "client",
        help="the data path through kvpool.Client: get_into GB/s, 4 KiB get p50, batches, "
        "puts, tcp against shared memory, two processes, machine limits",
        add_help=False,
    )
    b.set_defaults(forward_unknown=True)  # its own flags: --rounds, --quick, --json, --dir

    return parser


def _run(args: argparse.Namespace) -> int:
    if args.bench_command == "data-plane":
        from kvpool_bench.data_plane import main as data_plane_main

        return data_plane_main(args.rest)
    if args.bench_command == "client":
        from kvpool_bench.client import main as client_main

        return client_main(args.rest)
    if args.bench_command == "peers":
        from kvpool_bench.peers_cli import main_peers

        return main_peers(args)
    if args.bench_command == "engines":
        from kvpool_bench.engines import main_engines

        return main_engines(args)
    if args.bench_command == "tracing":
        from kvpool_bench.tracing import bench_tracing

        print_result(bench_tracing(args.rounds, args.gets, args.dir), args.json)
        return EXIT_OK
    if args.bench_command == "replicas":
        from kvpool_bench.replicas import main_bench

        print_result(main_bench(args), args.json)
        return EXIT_OK
    from kvpool_bench.cluster import bench_cluster, bench_index, bench_tiers

    if args.bench_command == "cluster":
        result = bench_cluster(
            rounds=args.rounds, kills=args.kills, directory=args.dir, pauses=args.pauses
        )
    elif args.bench_command == "tiers":
        result = bench_tiers(quick=args.quick, directory=args.dir)
    else:
        result = bench_index(quick=args.quick)
    print_result(result, args.json)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_forwarding(_parser(), sys.argv[1:] if argv is None else argv)
    return exit_status(f"kvpool-bench {args.bench_command}", lambda: _run(args))
