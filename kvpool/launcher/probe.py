"""Asking every master (and node) how it is: the data behind ``kvpool status`` and the
launcher's waits."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.errors import KVPoolError
from kvpool.grpcutil import call_metadata, create_channel, unary
from kvpool.proto.v1 import master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.security import Security, env_security


@dataclass
class MasterProbe:
    address: str
    status: master_pb2.ClusterStatusResponse | None
    error: str = ""


@dataclass
class NodeProbe:
    address: str
    stats: node_pb2.GetStatsResponse | None
    error: str = ""


async def _probe_master(address: str, timeout_s: float, security: Security) -> MasterProbe:
    channel = create_channel(address, security)
    try:
        stub = master_pb2_grpc.MasterStub(channel)
        status = await unary(
            stub.ClusterStatus,
            master_pb2.ClusterStatusRequest(),
            timeout_s=timeout_s,
            address=address,
            metadata=call_metadata(security),
        )
        return MasterProbe(address, status)
    except KVPoolError as e:
        return MasterProbe(address, None, e.message)
    finally:
        await channel.close()


async def _probe_node(address: str, timeout_s: float, security: Security) -> NodeProbe:
    channel = create_channel(address, security)
    try:
        stub = node_pb2_grpc.NodeAdminStub(channel)
        stats = await unary(
            stub.GetStats,
            node_pb2.GetStatsRequest(),
            timeout_s=timeout_s,
            address=address,
            metadata=call_metadata(security),
        )
        return NodeProbe(address, stats)
    except KVPoolError as e:
        return NodeProbe(address, None, e.message)
    finally:
        await channel.close()


async def probe_masters_async(
    addresses: Sequence[str], timeout_s: float, security: Security | None = None
) -> list[MasterProbe]:
    """``security``: the cluster token and TLS files (default: from the environment)."""
    sec = security if security is not None else env_security()
    return list(await asyncio.gather(*(_probe_master(a, timeout_s, sec) for a in addresses)))


async def probe_nodes_async(
    addresses: Sequence[str], timeout_s: float, security: Security | None = None
) -> list[NodeProbe]:
    sec = security if security is not None else env_security()
    return list(await asyncio.gather(*(_probe_node(a, timeout_s, sec) for a in addresses)))


def probe_masters(
    addresses: Sequence[str], timeout_s: float = 1.0, security: Security | None = None
) -> list[MasterProbe]:
    return asyncio.run(probe_masters_async(addresses, timeout_s, security))


def probe_nodes(
    addresses: Sequence[str], timeout_s: float = 1.0, security: Security | None = None
) -> list[NodeProbe]:
    return asyncio.run(probe_nodes_async(addresses, timeout_s, security))


def leader_of(probes: Sequence[MasterProbe]) -> MasterProbe | None:
    """The master that says it leads, with the highest term when several do (a deposed leader
    may not know it yet)."""
    leaders = [p for p in probes if p.status is not None and p.status.master.role == "leader"]
    if not leaders:
        return None
    return max(leaders, key=lambda p: p.status.master.term if p.status else 0)
