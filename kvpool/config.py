"""Configuration: one frozen dataclass per process, from defaults < TOML < ``KVPOOL_*`` env < flags.

Each field carries its help text and kind in ``metadata``; the CLI builds its flags from the same
fields, so ``--help`` and the TOML keys and the environment variables always agree:

=====================  =================================  ==================================
field                  TOML key (section ``[master]``…)   environment
=====================  =================================  ==================================
``cpu_cache_size``     ``cpu_cache_size = "16GiB"``       ``KVPOOL_CPU_CACHE_SIZE=16GiB``
=====================  =================================  ==================================

Every invalid value is reported at start, all at once, each with its name (:class:`ConfigError`).
No module reads global configuration: the process assembles its config once and passes it down.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from kvpool.errors import ConfigError
from kvpool.security import Security, TlsFiles, bind_problems, read_token
from kvpool.security import is_loopback_host as is_loopback_host  # noqa: PLC0414 - re-exported
from kvpool.transports import limits
from kvpool.units import parse_duration, parse_size

ENV_PREFIX = "KVPOOL_"
_HOSTPORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")

C = TypeVar("C")


AUTO_OFF = ("auto", "off")
"""The words a port setting takes besides an address (``rpc_listen``, ``read_listen``)."""


def opt(default: Any, help: str, kind: str = "", *, flag: bool = True) -> Any:
    """A config field: ``kind`` is ``size`` (bytes with units), ``duration`` (seconds), ``secret``
    (never printed) or ``""`` (by type)."""
    return field(default=default, metadata={"help": help, "kind": kind, "flag": flag})


def split_hostport(address: str) -> tuple[str, int]:
    """``"127.0.0.1:7300"`` → ``("127.0.0.1", 7300)``; raises ValueError naming the problem."""
    m = _HOSTPORT.match(address.strip())
    if not m:
        raise ValueError(f"not a host:port address: {address!r}")
    port = int(m.group("port"))
    if port > 65535:
        raise ValueError(f"port {port} out of range in {address!r}")
    return m.group("host").strip("[]"), port


def physical_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes(cgroup_files: tuple[str, ...] = _CGROUP_LIMITS) -> int:
    """The memory this process may use: the machine's, or its container's limit (cgroup v2 or
    v1) where that is lower — in Kubernetes the pod's limit, which the kernel enforces by
    killing the process."""
    limit = physical_memory_bytes()
    for path in cgroup_files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


NODE_OWN_MEMORY_BYTES = 512 << 20
"""What a store node needs besides its CPU tier, at the least (the interpreter, numpy, the block
table, buffers): a container limit below the tier plus this is refused at start."""

INDEX_ENTRY_BYTES = 240
"""A master's memory per index entry (``kvpool-bench index``, ``index_memory``)."""
INDEX_SHED_FROM = 0.9
"""Of ``index_max_entries``, the size past which the leader asks nodes to shed their coldest
blocks (``index_shed``): the entries above it, shared out by each node's replicas."""
INDEX_MEMORY_FRACTION = 0.4
"""Of a master's memory, what the index may fill when ``index_max_entries`` is 0: the rest is
the snapshot's fork (copy-on-write pages while it writes), the Raft log and the buffers."""


# --- process configs -----------------------------------------------------------------------


@dataclass(frozen=True)
class LogConfig:
    log_level: str = opt("info", "log level: debug, info, warning, error")
    log_format: str = opt("auto", "log format: json, console, or auto (console on a terminal)")


@dataclass(frozen=True)
class SecurityConfig:
    """The cluster token and TLS files (see :mod:`kvpool.security`)."""

    cluster_token: str = opt(
        "",
        "shared secret of the cluster, required on every connection when set (env or TOML "
        "only: a flag would show in `ps`); without one, services listen on loopback only",
        "secret",
        flag=False,
    )
    cluster_token_file: str = opt("", "file whose first line is the cluster token")
    tls_cert_file: str = opt(
        "", "PEM certificate: served by the gRPC servers, presented as a client certificate"
    )
    tls_key_file: str = opt("", "PEM private key of tls_cert_file")
    tls_ca_file: str = opt(
        "",
        "PEM CA bundle: masters are dialled over TLS checked against it (client certificates "
        "too, with tls_client_auth)",
    )
    tls_server_name: str = opt(
        "", "name expected in the masters' certificates (default: the host dialled)"
    )

    def security(self) -> Security:
        """The token read (from its file) and the TLS files; ConfigError when unreadable."""
        return Security(
            token=read_token(self.cluster_token, self.cluster_token_file),
            tls=TlsFiles(
                cert_file=self.tls_cert_file,
                key_file=self.tls_key_file,
                ca_file=self.tls_ca_file,
                client_auth=bool(getattr(self, "tls_client_auth", False)),
                server_name=self.tls_server_name,
            ),
        )

    def _security_problems(self, binds: tuple[str, ...] = ()) -> list[str]:
        errors: list[str] = []
        try:
            token = read_token(self.cluster_token, self.cluster_token_file)
        except ConfigError as e:
            errors.append(e.message)
            token = b"?"  # reported already; do not add the bind refusal on top
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            errors.append("tls_cert_file/tls_key_file: set both or neither")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                errors.append(f"{name}: cannot read {path}")
        if getattr(self, "tls_client_auth", False) and not (
            self.tls_ca_file and self.tls_cert_file
        ):
            errors.append(
                "tls_client_auth: needs tls_cert_file, tls_key_file and tls_ca_file (the CA "
                "that signed the client certificates)"
            )
        addresses = {name: str(getattr(self, name)) for name in binds}
        errors += bind_problems(addresses, token_set=bool(token))
        return errors


@dataclass(frozen=True)
class ServerSecurityConfig(SecurityConfig):
    tls_client_auth: bool = opt(
        False, "require client certificates signed by tls_ca_file on the gRPC servers (mTLS)"
    )


@dataclass(frozen=True)
class IngressConfig:
    """What peers may cost a server (:mod:`kvpool.transports.limits`), masters and nodes."""

    max_connections: int = opt(
        limits.MAX_CONNECTIONS,
        "most connections each data-plane/RPC port holds at once; one more is closed at once",
    )
    frame_timeout_s: float = opt(
        limits.FRAME_TIMEOUT_S,
        "a request frame (or a shared-memory reservation) not complete this long after its "
        "first byte closes its connection, freeing what it reserved",
        "duration",
    )
    request_memory: int = opt(
        limits.REQUEST_MEMORY_BYTES,
        "memory all connections together may hold for request payloads other than block bytes "
        "(RPC calls, key tables); beyond it requests are refused (retryable)",
        "size",
    )
    max_request_size: int = opt(
        limits.MAX_REQUEST_BYTES,
        "largest such payload of one request (a larger one is refused before it is read)",
        "size",
    )

    def ingress_limits(self) -> limits.IngressLimits:
        return limits.IngressLimits(
            max_connections=self.max_connections,
            frame_timeout_s=self.frame_timeout_s,
            request_memory_bytes=self.request_memory,
            max_request_bytes=self.max_request_size,
        )

    def _ingress_problems(self) -> list[str]:
        errors = []
        if self.max_connections < 1:
            errors.append("max_connections: must be at least 1")
        if self.frame_timeout_s <= 0:
            errors.append("frame_timeout_s: must be positive")
        if self.max_request_size < 64 << 10:
            errors.append("max_request_size: must be at least 64KiB")
        if self.request_memory < self.max_request_size:
            errors.append("request_memory: must be at least max_request_size")
        return errors


@dataclass(frozen=True)
class MasterConfig(ServerSecurityConfig, LogConfig, IngressConfig):
    """A `kvpool master`: one member of the Raft group holding the block index."""

    listen: str = opt("127.0.0.1:7300", "gRPC address (host:port) clients and nodes call")
    raft_listen: str = opt("127.0.0.1:7310", "Raft address (host:port) the other masters dial")
    raft_peers: tuple[str, ...] = opt((), "Raft addresses of the other masters, comma-separated")
    data_dir: str = opt(
        "", "directory for the Raft journal and snapshots (required unless --in-memory)"
    )
    in_memory: bool = opt(False, "keep the index in memory only (tests, demos): lost on restart")
    raft_secret: str = opt(
        "",
        "shared secret of the master group (encrypts and authenticates Raft traffic); required",
        "secret",
    )
    heartbeat_interval_s: float = opt(1.0, "how often store nodes heartbeat", "duration")
    node_timeout_s: float = opt(5.0, "a node silent this long is declared down", "duration")
    restore_grace_s: float = opt(
        30.0,
        "a node declared down keeps its index entries this long (invisible to lookups), so "
        "that it can claim its SSD blocks back after a restart",
        "duration",
    )
    raft_min_timeout_s: float = opt(0.3, "Raft election timeout, lower bound", "duration")
    raft_max_timeout_s: float = opt(0.6, "Raft election timeout, upper bound", "duration")
    raft_append_period_s: float = opt(0.05, "Raft leader heartbeat period", "duration")
    raft_leader_fallback_s: float = opt(
        2.0, "an isolated leader steps down after this long without a quorum", "duration"
    )
    raft_read_lease: bool = opt(
        True,
        "lookups answered by the leader only while it holds a lease (pre-vote on): every "
        "acknowledged write is seen by every later lookup; off = any master answers from its "
        "own copy, possibly stale (only while upgrading from a release without leases)",
    )
    raft_tick_on_loop: bool | None = opt(
        None,
        "run Raft (PySyncObj's tick) on the master's event loop rather than on a thread of its "
        "own: no thread hop between a request and its commit (4 KiB puts ~0.85x the time); "
        "auto (the default) = on with data_dir, off in memory (where it cannot run); true needs "
        "data_dir",
    )
    raft_connection_timeout_s: float = opt(2.0, "Raft peer connection timeout", "duration")
    raft_connection_retry_s: float = opt(1.0, "Raft redial period for lost peers", "duration")
    raft_max_message_bytes: int = opt(
        64 << 20,
        "longest Raft peer message accepted after the handshake (a longer length prefix closes "
        "the connection before anything is buffered; before it: 64 KiB)",
        "size",
    )
    raft_compress_level: int = opt(
        0,
        "zlib level (0-9) of Raft peer messages: 0 sends them stored (least CPU on the leader, "
        "which encodes each append once per follower); 1-9 trade leader CPU for fewer bytes "
        "on a slow link; peers decode any level",
    )
    raft_session_cipher: bool = opt(
        True,
        "Raft messages after each peer connection's handshake go AES-256-GCM under keys of that "
        "connection (a tenth of Fernet's cost, ~300 µs of a put); false: PySyncObj's Fernet "
        "for all, as releases before 2026-12-05 send and read (set it while upgrading from one)",
    )
    raft_message_timeout_s: float = opt(
        5.0,
        "a Raft peer connection must finish its handshake, and each message must arrive whole, "
        "within this long, else it is closed",
        "duration",
    )
    raft_compaction_min_entries: int = opt(20000, "compact the Raft log after this many entries")
    raft_compaction_min_time_s: float = opt(
        300.0, "compact the Raft log at least this often", "duration"
    )
    commit_batch_max_entries: int = opt(
        8192, "most put entries merged into one Raft entry (group commit)"
    )
    commit_timeout_s: float = opt(5.0, "longest wait for one Raft commit", "duration")
    stuck_follower_s: float = opt(
        5.0, "force a snapshot for a follower whose log has not advanced this long", "duration"
    )
    dedupe_capacity: int = opt(65536, "request ids remembered for exactly-once retries")
    dedupe_max_bytes: int = opt(
        64 << 20, "memory bound of the remembered results of those request ids", "size"
    )
    index_max_entries: int = opt(
        0,
        "refuse puts of keys the index does not hold once it holds this many entries, so that "
        "no master runs out of memory (every master holds the whole index); 0: what 0.4 of "
        "this host's or container's memory holds at 240 bytes an entry",
    )
    index_shed: bool = opt(
        True,
        "past nine tenths of index_max_entries, ask the nodes (in their heartbeats' answers) "
        "to drop their coldest blocks, so that new keys keep getting into a full index; false: "
        "a full index refuses new keys until blocks leave it by themselves",
    )
    advertise_address: str = opt(
        "",
        "gRPC address (host:port) other processes dial to reach this master "
        "(default: listen, with the port actually bound)",
    )
    hot_reads_per_s: float = opt(
        50.0, "a block read more often than this (reads/s, all nodes) gains replicas; 0 = off"
    )
    hot_half_life_s: float = opt(5.0, "half-life of the decayed read counters", "duration")
    hot_max_replicas: int = opt(3, "replicas a hot block is raised to (capped by live nodes)")
    pin_quota: int = opt(
        1 << 30,
        "most bytes pinned, counted as size x replicas over pinned keys; 0 = no bound",
        "size",
    )
    repair_blocks_per_s: float = opt(
        2000.0, "most blocks copied per second for repair, drain, pins and hot blocks; 0 = no bound"
    )
    repair_bytes_per_s: int = opt(
        256 << 20, "most bytes copied per second by the same; 0 = no bound", "size"
    )
    ready_file: str = opt("", "write a JSON file with the bound addresses once serving", flag=True)
    rpc_listen: str = opt(
        "auto",
        "frame RPC port for clients' hot calls (lookups, commits) without gRPC's per-call cost: "
        "host:port, 'auto' (the gRPC host, any free port; offered only when this master is "
        "dialled directly, not through a proxy or NAT: advertise_address unset) or 'off'",
    )
    read_listen: str = opt(
        "auto",
        "read port: the RPC port's index reads (Lookup, PrefixMatch, GetMembers) answered by a "
        "thread per connection, without the event loop: host:port, 'auto' (the RPC port's "
        "host, any free port) or 'off'; offered whenever the RPC port is",
    )
    read_threads: int = opt(
        512,
        "most connections the read port serves at once, each by a thread of its own (~90 KiB "
        "each); one more is closed at once and its client reads over the RPC port",
    )
    metrics_port: int = opt(
        0,
        "Prometheus /metrics HTTP port on the listen host: 0 = any free port (logged as "
        "metrics_serving, in the ready file), -1 = off",
    )
    max_lookup_keys: int = opt(
        16384,
        "most keys in one Lookup or PrefixMatch (more is refused: REQUEST_TOO_LARGE), which "
        "bounds the time one request holds the event loop",
    )
    max_node_capacity: int = opt(
        1 << 50, "largest capacity a store node may register with (larger is refused)", "size"
    )

    @property
    def ticks_on_loop(self) -> bool:
        """Whether Raft runs on the event loop: ``raft_tick_on_loop``, with auto (None) on
        wherever the index has a ``data_dir``."""
        if self.raft_tick_on_loop is None:
            return not self.in_memory
        return self.raft_tick_on_loop

    def index_entry_limit(self) -> int:
        """``index_max_entries``, or when that is 0 what this host's (or container's) memory
        allows: :data:`INDEX_MEMORY_FRACTION` of it at :data:`INDEX_ENTRY_BYTES` an entry."""
        if self.index_max_entries:
            return self.index_max_entries
        return max(1, int(memory_limit_bytes() * INDEX_MEMORY_FRACTION) // INDEX_ENTRY_BYTES)

    def validate(self) -> list[str]:
        errors = _validate_addresses(self, ("listen", "raft_listen"))
        errors += self._ingress_problems()
        if self.max_lookup_keys < 1:
            errors.append("max_lookup_keys: must be at least 1")
        if self.read_threads < 1:
            errors.append("read_threads: must be at least 1 (read_listen = 'off' turns it off)")
        if self.max_node_capacity < 1:
            errors.append("max_node_capacity: must be positive")
        frame_ports = tuple(
            name for name in ("rpc_listen", "read_listen") if getattr(self, name) not in AUTO_OFF
        )
        errors += _validate_addresses(self, frame_ports)
        # raft_listen is not refused: Raft traffic is authenticated by raft_secret already.
        errors += self._security_problems(("listen", *frame_ports))
        for peer in self.raft_peers:
            try:
                split_hostport(peer)
            except ValueError as e:
                errors.append(f"raft_peers: {e}")
        if self.raft_listen in self.raft_peers:
            errors.append("raft_peers: must not contain this master's own raft_listen address")
        if not self.in_memory and not self.data_dir:
            errors.append(
                "data_dir: required unless in_memory is set (the index must survive a restart)"
            )
        if self.raft_tick_on_loop is True and self.in_memory:
            errors.append(
                "raft_tick_on_loop: needs data_dir (in memory, a log compaction pickles the whole "
                "index in the tick, which would hold the event loop for seconds)"
            )
        if not self.raft_secret:
            errors.append(
                "raft_secret: required; Raft peer traffic is pickle and must be "
                "authenticated (set KVPOOL_RAFT_SECRET or --raft-secret)"
            )
        if not 0 < self.raft_min_timeout_s < self.raft_max_timeout_s:
            errors.append("raft_min_timeout_s/raft_max_timeout_s: need 0 < min < max")
        if not 0 < self.raft_append_period_s < self.raft_min_timeout_s:
            errors.append("raft_append_period_s: must be positive and below raft_min_timeout_s")
        elif self.raft_append_period_s * 3 >= self.raft_min_timeout_s:
            errors.append(
                "raft_append_period_s: must be below a third of raft_min_timeout_s (PySyncObj)"
            )
        if self.advertise_address:
            try:
                split_hostport(self.advertise_address)
            except ValueError as e:
                errors.append(f"advertise_address: {e}")
        if self.raft_leader_fallback_s <= self.raft_max_timeout_s:
            errors.append("raft_leader_fallback_s: must exceed raft_max_timeout_s")
        if self.raft_connection_timeout_s <= self.raft_max_timeout_s:
            errors.append("raft_connection_timeout_s: must exceed raft_max_timeout_s")
        if not 0 < self.heartbeat_interval_s < self.node_timeout_s:
            errors.append("heartbeat_interval_s: must be positive and below node_timeout_s")
        for name in (
            "raft_compaction_min_entries",
            "commit_batch_max_entries",
            "dedupe_capacity",
            "dedupe_max_bytes",
        ):
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be at least 1")
        if self.index_max_entries < 0:
            errors.append("index_max_entries: must be 0 (from memory) or positive")
        if self.raft_compaction_min_entries == 1:
            errors.append("raft_compaction_min_entries: must be at least 2 (PySyncObj)")
        if self.raft_max_message_bytes < MIN_RAFT_MESSAGE_BYTES:
            errors.append(
                "raft_max_message_bytes: must be at least 4 MiB (an append carries up to 1 MiB "
                "of entries plus one more entry, and encryption's base64 adds a third)"
            )
        if not 0 <= self.raft_compress_level <= 9:
            errors.append("raft_compress_level: must be 0 to 9 (a zlib level)")
        if self.raft_message_timeout_s <= 0:
            errors.append("raft_message_timeout_s: must be positive")
        if self.raft_compaction_min_time_s <= 0:
            errors.append("raft_compaction_min_time_s: must be positive")
        if self.commit_timeout_s <= 0:
            errors.append("commit_timeout_s: must be positive")
        if self.stuck_follower_s <= 0:
            errors.append("stuck_follower_s: must be positive")
        if self.restore_grace_s < 0:
            errors.append("restore_grace_s: must not be negative")
        if not -1 <= self.metrics_port <= 65535:
            errors.append("metrics_port: must be -1 (off), 0 (any free port) or a port number")
        for name in ("hot_reads_per_s", "pin_quota", "repair_blocks_per_s", "repair_bytes_per_s"):
            if getattr(self, name) < 0:
                errors.append(f"{name}: must not be negative")
        if self.hot_half_life_s <= 0:
            errors.append("hot_half_life_s: must be positive")
        if self.hot_max_replicas < 1:
            errors.append("hot_max_replicas: must be at least 1")
        return errors


@dataclass(frozen=True)
class NodeConfig(ServerSecurityConfig, LogConfig, IngressConfig):
    """A `kvpool node`: one store node holding block bytes."""

    node_id: str = opt("", "stable name of this node (default: the host name)")
    masters: tuple[str, ...] = opt(("127.0.0.1:7300",), "gRPC addresses of the masters")
    listen: str = opt("127.0.0.1:0", "gRPC address of the admin service (port 0 = any)")
    data_listen: str = opt("127.0.0.1:0", "data-plane TCP address (port 0 = any)")
    advertise_host: str = opt("", "host clients should dial (default: the listen host)")
    advertise_data_address: str = opt(
        "",
        "data address clients should dial, e.g. tcp://proxy:7400, when it differs from the "
        "bound one (a proxy or NAT in between; default: tcp://<advertise host>:<bound port>)",
    )
    zone: str = opt("", "failure-domain label (rack, zone) for replica anti-affinity")
    cpu_cache_size: int = opt(1 << 30, "size of the CPU (shared-memory) tier", "size")
    cpu_tier_prefault: bool = opt(
        True,
        "fault the CPU tier's memory in at start, in the background (PUTs into untouched "
        "memory are ~10x slower); commits the whole tier's memory",
    )
    max_memory_fraction: float = opt(
        0.7, "refuse a CPU tier above this share of the machine's memory"
    )
    high_watermark: float = opt(0.85, "start evicting above this fill of a tier (every tier)")
    low_watermark: float = opt(0.70, "evict down to this fill of a tier (every tier)")
    eviction_policy: str = opt(
        "s3fifo", "eviction policy of the CPU and GPU tiers, by name: s3fifo or lru"
    )
    ssd_cache_path: str = opt("", "directory of the SSD tier's files (empty: no SSD tier)")
    ssd_cache_size: int = opt(
        0, "size of the SSD tier, preallocated under ssd_cache_path (0: no SSD tier)", "size"
    )
    ssd_segment_size: int = opt(
        64 << 20,
        "the SSD tier is filled and reclaimed in segments of this size (blocks larger than a "
        "segment are dropped rather than demoted)",
        "size",
    )
    ssd_write_batch_size: int = opt(
        8 << 20, "most bytes of demoted blocks gathered into one SSD write", "size"
    )
    ssd_direct_io: bool = opt(
        True, "use O_DIRECT on the SSD tier where the filesystem allows (else buffered I/O)"
    )
    gpu_cache_size: int = opt(
        0, "size of the GPU tier in device memory (0: none; needs cupy and a CUDA device)", "size"
    )
    gpu_device: int = opt(0, "CUDA device of the GPU tier")
    promote_after_hits: int = opt(
        2, "reads of a block on the SSD tier after which it is copied back to CPU memory"
    )
    gpu_promote_after_hits: int = opt(
        4, "reads of a block in CPU memory after which it is copied to the GPU tier"
    )
    report_tiers: bool = opt(
        True, "tell the index when a block moves between tiers (hints for cost-aware reads)"
    )
    tier_threads: int = opt(4, "threads reading the SSD and GPU tiers")
    lease_timeout_s: float = opt(
        30.0,
        "a connection whose responses have not left (or whose shared-memory leases have not "
        "been released) in this long is cut, ending its leases",
        "duration",
    )
    data_shm: bool = opt(
        True,
        "offer clients on this host the CPU tier through shared memory (shm://, an abstract "
        "unix socket; clients behind a proxy or NAT keep using tcp)",
    )
    data_shm_directory: bool = opt(
        True,
        "with data_shm: list the committed blocks in memory in a shared directory that "
        "same-host clients read them through with no message to the node (each copy checked "
        "against its checksum; see operations.md, 'Shared-memory directory')",
    )
    max_block_size: int = opt(64 << 20, "largest block accepted", "size")
    put_memory_fraction: float = opt(
        0.5,
        "most of the CPU tier that PUTs whose bytes are still arriving may hold; beyond it a "
        "PUT is refused (NO_SPACE, retryable) without evicting anything",
    )
    staged_ttl_s: float = opt(
        30.0,
        "staged (uncommitted) blocks older than this are checked against the index and "
        "reclaimed; a write a read missed here and still absent this long after is reported "
        "gone if the index names it on this node",
        "duration",
    )
    eviction_report_interval_s: float = opt(
        0.2, "how often evictions are reported to the index", "duration"
    )
    request_timeout_s: float = opt(5.0, "timeout of calls to the masters", "duration")
    ready_file: str = opt("", "write a JSON file with the bound addresses once registered")
    metrics_port: int = opt(
        0,
        "Prometheus /metrics HTTP port on the listen host: 0 = any free port (logged as "
        "metrics_serving, in the ready file), -1 = off",
    )

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    def validate(self) -> list[str]:
        errors = _validate_addresses(self, ("listen", "data_listen"))
        errors += _validate_masters(self.masters)
        errors += self._ingress_problems()
        if not 0 < self.put_memory_fraction <= 1:
            errors.append("put_memory_fraction: must be in (0, 1]")
        errors += self._security_problems(("listen", "data_listen"))
        if self.advertise_data_address:
            scheme, _, rest = self.advertise_data_address.partition("://")
            try:
                if scheme != "tcp":
                    raise ValueError(
                        f"not a tcp://host:port address: {self.advertise_data_address!r}"
                    )
                split_hostport(rest)
            except ValueError as e:
                errors.append(f"advertise_data_address: {e}")
        if self.cpu_cache_size <= 0:
            errors.append("cpu_cache_size: must be positive")
        limit = int(physical_memory_bytes() * self.max_memory_fraction)
        if self.cpu_cache_size > limit:
            errors.append(
                f"cpu_cache_size: {self.cpu_cache_size} bytes is above "
                f"{self.max_memory_fraction:.0%} of this machine's memory ({limit} bytes); "
                "lower it or raise max_memory_fraction"
            )
        container = memory_limit_bytes()
        if container < physical_memory_bytes() and (
            self.cpu_cache_size + NODE_OWN_MEMORY_BYTES > container
        ):
            errors.append(
                f"cpu_cache_size: {self.cpu_cache_size} bytes plus ~"
                f"{NODE_OWN_MEMORY_BYTES >> 20} MiB for the node itself is above this "
                f"container's memory limit ({container} bytes): the kernel would kill the node "
                "as it fills the tier; raise the limit to the tier plus ~1 GiB "
                "(docs/operations.md, Sizing) or lower cpu_cache_size"
            )
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            errors.append("low_watermark/high_watermark: need 0 < low < high <= 1")
        if not 0 < self.max_memory_fraction <= 1:
            errors.append("max_memory_fraction: must be in (0, 1]")
        if not self.eviction_policy:
            errors.append("eviction_policy: must name a policy (s3fifo, lru)")
        errors += self._validate_tiers()
        if self.staged_ttl_s <= 0:
            errors.append("staged_ttl_s: must be positive")
        if self.eviction_report_interval_s <= 0:
            errors.append("eviction_report_interval_s: must be positive")
        if self.request_timeout_s <= 0:
            errors.append("request_timeout_s: must be positive")
        if self.max_block_size <= 0:
            errors.append("max_block_size: must be positive")
        elif self.max_block_size > self.cpu_cache_size:
            errors.append("max_block_size: must not exceed cpu_cache_size")
        if not -1 <= self.metrics_port <= 65535:
            errors.append("metrics_port: must be -1 (off), 0 (any free port) or a port number")
        return errors

    def _validate_tiers(self) -> list[str]:
        errors = []
        if self.ssd_cache_size and not self.ssd_cache_path:
            errors.append("ssd_cache_path: required when ssd_cache_size is set")
        if self.ssd_cache_path and not self.ssd_cache_size:
            errors.append("ssd_cache_size: required when ssd_cache_path is set")
        if self.ssd_segment_size <= 0 or self.ssd_segment_size % 4096:
            errors.append("ssd_segment_size: must be a positive multiple of 4 KiB")
        elif self.ssd_cache_size and self.ssd_cache_size < 2 * self.ssd_segment_size:
            errors.append(
                f"ssd_cache_size: {self.ssd_cache_size} bytes holds fewer than 2 segments of "
                f"ssd_segment_size ({self.ssd_segment_size} bytes)"
            )
        if self.ssd_write_batch_size <= 0 or self.ssd_write_batch_size % 4096:
            errors.append("ssd_write_batch_size: must be a positive multiple of 4 KiB")
        if self.gpu_cache_size < 0:
            errors.append("gpu_cache_size: must not be negative")
        if self.gpu_device < 0:
            errors.append("gpu_device: must not be negative")
        for name in ("promote_after_hits", "gpu_promote_after_hits", "tier_threads"):
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be at least 1")
        if self.lease_timeout_s <= 0:
            errors.append("lease_timeout_s: must be positive")
        return errors


MIN_RAFT_MESSAGE_BYTES = 4 << 20
"""Smallest ``raft_max_message_bytes``: a legitimate append must always fit."""

MAX_BUSY_POLL_US = 10_000
"""Longest ``ClientConfig.busy_poll_us``: past a few hundred µs spinning only burns CPU."""

DIRECT_READS = ("scheme", "all", "off")
"""The values of ``ClientConfig.direct_reads``."""


@dataclass(frozen=True)
class ClientConfig(SecurityConfig):
    """A client embedded in an engine."""

    masters: tuple[str, ...] = opt(("127.0.0.1:7300",), "gRPC addresses of the masters")
    timeout_s: float = opt(2.0, "deadline of every call", "duration")
    replicas: int = opt(1, "replicas written per block")
    max_value_size: int = opt(64 << 20, "largest value accepted by put", "size")
    connections_per_node: int = opt(
        2,
        "data-plane connections pooled per node (the sync client: besides each thread's own,"
        " those kept from threads that ended)",
    )
    max_tier: str = opt(
        "", "slowest tier a get accepts: gpu, cpu or ssd (empty: any); slower is a miss"
    )
    transport: str = opt(
        "auto",
        "data path to the nodes: auto (shared memory for a node on this host, else tcp), "
        "tcp, or shm (shared memory only)",
    )
    lookup_cache_size: int = opt(
        65536,
        "index entries the client keeps, of keys it read or wrote (~380 bytes each; 0: every "
        "get asks the masters)",
    )
    lookup_cache_ttl_s: float = opt(
        30.0, "longest a cached index entry is used without asking the masters", "duration"
    )
    hedge_reads: bool = opt(
        True, "read a key from a second replica too when the first is slow (see hedge_delay_ms)"
    )
    hedge_delay_ms: float = opt(
        10.0,
        "how long a read waits for its replica before hedging, plus 1 ms per MB it reads",
    )
    node_retry_ms: float = opt(
        1000.0,
        "after a request to a node fails (no connection, a broken one, or no answer at all), "
        "how long the client sends that node nothing before one request tries it again: reads "
        "of blocks held only there miss at once, puts go to the next node on the ring (0: off)",
    )
    metrics_port: int = opt(
        -1, "Prometheus /metrics of this client: -1 = off (default), 0 = any free port, or a port"
    )
    metrics_host: str = opt("127.0.0.1", "host the client's /metrics binds (with metrics_port)")
    direct_reads: str = opt(
        "scheme",
        "keys read from the node the ring places them on without asking the index first, for "
        "keys that name their content: scheme (kvpool's kv1/ keys), all (every key this client "
        "reads: one key never holds two different values), or off",
    )
    busy_poll_us: int = opt(
        0,
        "how long a blocking client spins for the answer to a read or a lookup before it "
        "sleeps, in microseconds (0: never spins; up to 10000): lower latency on machines "
        "whose idle CPUs are slow to wake, for that much of the calling thread's CPU per call",
    )

    def validate(self) -> list[str]:
        errors = _validate_masters(self.masters)
        if self.direct_reads not in DIRECT_READS:
            errors.append(
                f"direct_reads: expected {', '.join(DIRECT_READS)}, got {self.direct_reads!r}"
            )
        if not -1 <= self.metrics_port <= 65535:
            errors.append("metrics_port: must be -1 (off), 0 (any free port) or a port number")
        errors += self._security_problems()
        if self.transport not in ("auto", "tcp", "shm"):
            errors.append(f"transport: expected auto, tcp or shm, got {self.transport!r}")
        if self.lookup_cache_size < 0:
            errors.append("lookup_cache_size: must not be negative")
        if self.lookup_cache_ttl_s <= 0:
            errors.append("lookup_cache_ttl_s: must be positive")
        if self.max_tier.lower() not in ("", "any", "gpu", "cpu", "ssd"):
            errors.append(f"max_tier: expected gpu, cpu, ssd or any, got {self.max_tier!r}")
        if self.timeout_s <= 0:
            errors.append("timeout_s: must be positive")
        if self.hedge_delay_ms < 0:
            errors.append("hedge_delay_ms: must not be negative")
        if not 0 <= self.node_retry_ms <= 600_000:
            errors.append("node_retry_ms: must be between 0 (off) and 600000")
        if not 0 <= self.busy_poll_us <= MAX_BUSY_POLL_US:
            errors.append(f"busy_poll_us: must be between 0 and {MAX_BUSY_POLL_US}")
        if self.replicas < 1:
            errors.append("replicas: must be at least 1")
        if self.max_value_size <= 0:
            errors.append("max_value_size: must be positive")
        if self.connections_per_node < 1:
            errors.append("connections_per_node: must be at least 1")
        return errors


def _validate_masters(masters: tuple[str, ...]) -> list[str]:
    errors = [] if masters else ["masters: at least one master address is required"]
    for m in masters:
        try:
            split_hostport(m)
        except ValueError as e:
            errors.append(f"masters: {e}")
    return errors


def _validate_addresses(cfg: Any, names: tuple[str, ...]) -> list[str]:
    errors = []
    for name in names:
        try:
            split_hostport(getattr(cfg, name))
        except ValueError as e:
            errors.append(f"{name}: {e}")
    return errors


# --- loading ---------------------------------------------------------------------------------


def config_fields(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], type[Any]]]:
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def parse_value(f: dataclasses.Field[Any], typ: Any, raw: Any) -> Any:
    """Turn a TOML, env or flag value into the field's type; raises ValueError."""
    kind = f.metadata.get("kind", "")
    if kind == "size":
        return parse_size(raw)
    if kind == "duration":
        return parse_duration(raw)
    origin = get_origin(typ)
    if origin is tuple:
        if isinstance(raw, str):
            items = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, list | tuple):
            items = [str(s) for s in raw]
        else:
            raise ValueError(f"expected a list, got {raw!r}")
        return tuple(items)
    if origin in (Union, types.UnionType):
        if isinstance(raw, str) and raw.strip().lower() == "auto" and type(None) in get_args(typ):
            return None  # an optional setting's automatic choice
        typ = next(a for a in get_args(typ) if a is not type(None))
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {raw!r}")
    if typ is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"expected an integer, got {raw!r}")
        return int(raw)
    if typ is float:
        if isinstance(raw, bool):
            raise ValueError(f"expected a number, got {raw!r}")
        return float(raw)
    if typ is str:
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {raw!r}")
        return raw
    raise ValueError(f"unsupported config type {typ!r}")


def load_config(
    cls: type[C],
    *,
    toml_path: str | Path | None = None,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build and validate a config: defaults < TOML < env (``KVPOOL_<FIELD>``) < overrides.

    ``overrides`` holds already-parsed or raw values by field name (flags); ``None`` values are
    ignored. Raises ConfigError listing every problem.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    errors: list[str] = []
    fields = config_fields(cls)
    names = {f.name for f, _ in fields}

    if toml_path:
        try:
            with open(toml_path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {toml_path}: {e}") from e
        table = doc.get(section, doc) if section else doc
        if not isinstance(table, dict):
            raise ConfigError(f"config file {toml_path}: [{section}] is not a table")
        known_sections = {"master", "node", "client"}
        for key, raw in table.items():
            if key in known_sections and isinstance(raw, dict):
                continue
            if key not in names:
                errors.append(f"{key}: unknown setting in {toml_path}")
                continue
            values[key] = ("toml", raw)
    for f, _ in fields:
        env_key = ENV_PREFIX + f.name.upper()
        if env_key in env:
            values[f.name] = (env_key, env[env_key])
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in names:
            errors.append(f"{key}: unknown setting")
            continue
        values[key] = ("flag", raw)

    parsed: dict[str, Any] = {}
    for f, typ in fields:
        if f.name not in values:
            continue
        source, raw = values[f.name]
        try:
            parsed[f.name] = parse_value(f, typ, raw)
        except ValueError as e:
            errors.append(f"{f.name} (from {source}): {e}")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    cfg = cls(**parsed)
    validate = getattr(cfg, "validate", None)
    problems = validate() if validate else []
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return cfg


def redacted(cfg: Any) -> dict[str, Any]:
    """The config as a dict for logs, secrets replaced."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("kind") == "secret" and value:
            value = "***"
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
