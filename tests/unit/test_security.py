"""Security: the cluster token on the data plane (tcp, in-process, shared memory) and on gRPC,
TLS on gRPC, and the loopback-only rule — in one process, over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvpool.checksum import block_checksum
from kvpool.config import ClientConfig, MasterConfig, NodeConfig, load_config
from kvpool.errors import (
    ConfigError,
    DeadlineExceededError,
    TransportError,
    UnauthenticatedError,
    UnavailableError,
)
from kvpool.grpcutil import call_metadata, create_channel, start_server, unary
from kvpool.proto.v1 import node_pb2, node_pb2_grpc
from kvpool.proto.wire import Op, Status
from kvpool.security import Security, TlsFiles, read_token
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.transports import open_blocking, open_connection, schemes
from kvpool.transports.calls import Call

TOKEN = b"0123456789abcdef-test-token"
OTHER = b"fedcba9876543210-not-the-one"
TIMEOUT_S = 5.0
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def node(token: bytes, *, shm: bool = False) -> AsyncIterator[DataServer]:
    tier = CpuTier(16 << 20)
    store = BlockStore(tier, LruPolicy(), max_block_size=1 << 20, clock=lambda: 0.0)
    server = DataServer(store, shm=shm, inproc_name=f"sec-{id(store)}", token=token)
    try:
        await server.start("127.0.0.1", 0)
        yield server
    finally:
        await server.close()
        tier.close()


async def ping(address: str, token: bytes) -> int:
    conn = await open_connection(address, TIMEOUT_S, token)
    try:
        response = await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)
        return response.status
    finally:
        conn.close()


async def until(condition: Any, timeout_s: float = 3.0) -> None:
    """The server counts a refusal once it has closed the refused socket (after a short drain)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- the data plane ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["tcp", "inproc"])
def test_data_plane_admits_the_right_token_and_refuses_a_wrong_one(scheme: str) -> None:
    async def main() -> None:
        async with node(TOKEN) as server:
            address = f"tcp://127.0.0.1:{server.port}" if scheme == "tcp" else server.inproc_address
            assert await ping(address, TOKEN) == Status.OK
            with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
                await open_connection(address, TIMEOUT_S, OTHER)
            await until(lambda: server.gate.refused == 1)

    run(main())


def test_data_plane_without_a_token_is_refused_with_a_clear_error() -> None:
    async def main() -> None:
        async with node(TOKEN) as server:
            conn = await open_connection(f"tcp://127.0.0.1:{server.port}", TIMEOUT_S)
            try:
                with pytest.raises(UnauthenticatedError, match="requires the cluster token"):
                    await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)
            finally:
                conn.close()
            # a PUT with a payload is refused too, and nothing was stored
            data = b"x" * 4096
            conn = await open_connection(f"tcp://127.0.0.1:{server.port}", TIMEOUT_S)
            try:
                with pytest.raises(UnauthenticatedError):
                    await conn.request(
                        Op.PUT,
                        b"k",
                        write_id=1,
                        checksum=block_checksum(data),
                        payload=data,
                        timeout_s=TIMEOUT_S,
                    )
            finally:
                conn.close()
            assert server.store.tier.used_bytes == 0

    run(main())


def test_blocking_connections_prove_the_token_too() -> None:
    async def main() -> None:
        async with node(TOKEN) as server:
            address = f"tcp://127.0.0.1:{server.port}"

            def blocking(token: bytes) -> int:
                conn = open_blocking(address, TIMEOUT_S, token)
                try:
                    call = Call(Op.PING, b"")
                    conn.exchange([call], _deadline())
                    assert call.header is not None
                    return call.header.status
                finally:
                    conn.close()

            assert await asyncio.to_thread(blocking, TOKEN) == Status.OK
            with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
                await asyncio.to_thread(blocking, OTHER)
            with pytest.raises(UnauthenticatedError, match="requires the cluster token"):
                await asyncio.to_thread(blocking, b"")

    run(main())


def _deadline() -> float:
    import time

    return time.monotonic() + TIMEOUT_S


@pytest.mark.skipif("shm" not in schemes(), reason="shared memory is not supported here")
def test_shared_memory_hands_the_arena_only_to_the_token() -> None:
    async def main() -> None:
        async with node(TOKEN, shm=True) as server:
            assert server.shm_address
            assert await ping(server.shm_address, TOKEN) == Status.OK
            with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
                await open_connection(server.shm_address, TIMEOUT_S, OTHER)
            with pytest.raises(UnauthenticatedError):
                await asyncio.to_thread(open_blocking, server.shm_address, TIMEOUT_S, OTHER)
            # no token at all: the socket never gets the arena's fd (the client gives up waiting;
            # in practice its first, TCP, connection has been refused with UNAUTHORIZED already)
            with pytest.raises((DeadlineExceededError, TransportError)):
                await open_connection(server.shm_address, 0.5)
        async with node(b"", shm=True) as server:  # a client with a token, a node without
            assert await ping(server.shm_address, TOKEN) == Status.OK
            conn = await asyncio.to_thread(open_blocking, server.shm_address, TIMEOUT_S, TOKEN)
            conn.close()

    run(main())


def test_a_node_without_a_token_accepts_a_client_with_one() -> None:
    async def main() -> None:
        async with node(b"") as server:
            assert await ping(f"tcp://127.0.0.1:{server.port}", TOKEN) == Status.OK
            assert await ping(f"tcp://127.0.0.1:{server.port}", b"") == Status.OK

    run(main())


def test_the_token_is_checked_per_connection_not_per_frame() -> None:
    async def main() -> None:
        async with node(TOKEN) as server:
            conn = await open_connection(f"tcp://127.0.0.1:{server.port}", TIMEOUT_S, TOKEN)
            try:
                for _ in range(50):
                    response = await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)
                    assert response.status == Status.OK
            finally:
                conn.close()
            assert server.gate.refused == 0

    run(main())


# --- gRPC: token and TLS --------------------------------------------------------------------------


class _Admin:
    """Every NodeAdmin RPC (the generated registration looks each one up)."""

    async def GetStats(self, request: Any, context: Any) -> node_pb2.GetStatsResponse:
        return node_pb2.GetStatsResponse()

    async def CopyBlocks(self, request: Any, context: Any) -> node_pb2.CopyBlocksResponse:
        return node_pb2.CopyBlocksResponse()

    async def UpdateBlocks(self, request: Any, context: Any) -> node_pb2.UpdateBlocksResponse:
        return node_pb2.UpdateBlocksResponse()


def _certs(tmp: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    now = datetime.datetime.now(datetime.UTC)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("kvpool test CA"))
        .issuer_name(name("kvpool test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out = {}
    pem = serialization.Encoding.PEM
    (tmp / "ca.pem").write_bytes(ca.public_bytes(pem))
    out["ca"] = str(tmp / "ca.pem")
    for who, san in (
        ("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        ("client", [x509.DNSName("kvpool-client")]),
    ):
        k = key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(f"kvpool {who}"))
            .issuer_name(ca.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (tmp / f"{who}.pem").write_bytes(cert.public_bytes(pem))
        (tmp / f"{who}.key").write_bytes(
            k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        out[who] = str(tmp / f"{who}.pem")
        out[f"{who}_key"] = str(tmp / f"{who}.key")
    return out


async def _stats(port: int, security: Security, timeout_s: float = 3.0) -> Any:
    address = f"127.0.0.1:{port}"
    async with create_channel(address, security) as channel:
        stub = node_pb2_grpc.NodeAdminStub(channel)
        return await unary(
            stub.GetStats,
            node_pb2.GetStatsRequest(),
            timeout_s=timeout_s,
            address=address,
            metadata=call_metadata(security),
        )


async def _serve(security: Security) -> Any:
    return await start_server(
        "127.0.0.1:0",
        [(node_pb2_grpc.add_NodeAdminServicer_to_server, _Admin(), "kvpool.v1.NodeAdmin")],
        security=security,
    )


def test_grpc_requires_the_token_on_kvpool_calls() -> None:
    async def main() -> None:
        handle = await _serve(Security(token=TOKEN))
        try:
            await _stats(handle.port, Security(token=TOKEN))
            with pytest.raises(UnauthenticatedError, match="wrong cluster token"):
                await _stats(handle.port, Security(token=OTHER))
            with pytest.raises(UnauthenticatedError, match="requires its cluster token"):
                await _stats(handle.port, Security())
            # health stays open: probes (Kubernetes) carry no token
            async with create_channel(f"127.0.0.1:{handle.port}") as channel:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=3
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await handle.stop(0)

    run(main())


def test_grpc_tls_and_client_certificates(tmp_path: Path) -> None:
    certs = _certs(tmp_path)
    server_tls = TlsFiles(
        cert_file=certs["server"], key_file=certs["server_key"], ca_file=certs["ca"]
    )
    mtls = TlsFiles(
        cert_file=certs["server"], key_file=certs["server_key"], ca_file=certs["ca"],
        client_auth=True,
    )  # fmt: skip
    client = TlsFiles(ca_file=certs["ca"])
    client_with_cert = TlsFiles(
        ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client_key"]
    )

    async def main() -> None:
        handle = await _serve(Security(token=TOKEN, tls=server_tls))
        try:
            await _stats(handle.port, Security(token=TOKEN, tls=client))
            # a plaintext client against a TLS server
            with pytest.raises(UnavailableError, match="server uses TLS"):
                await _stats(handle.port, Security(token=TOKEN), timeout_s=2.0)
        finally:
            await handle.stop(0)
        handle = await _serve(Security(token=TOKEN, tls=mtls))
        try:
            await _stats(handle.port, Security(token=TOKEN, tls=client_with_cert))
            # no client certificate: refused
            with pytest.raises(UnavailableError, match="client certificates"):
                await _stats(handle.port, Security(token=TOKEN, tls=client), timeout_s=2.0)
        finally:
            await handle.stop(0)

    run(main())


# --- configuration ----------------------------------------------------------------------------


def test_non_loopback_bind_is_refused_without_a_token(tmp_path: Path) -> None:
    for cls, name, address in (
        (NodeConfig, "data_listen", "0.0.0.0:7400"),
        (NodeConfig, "listen", "10.1.2.3:7401"),
        (MasterConfig, "listen", "0.0.0.0:7300"),
    ):
        overrides = {name: address, "raft_secret": "s", "in_memory": True}
        if cls is NodeConfig:
            overrides = {name: address}
        with pytest.raises(ConfigError, match=f"{name}: {address} is not a loopback address"):
            load_config(cls, env={}, overrides=overrides)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN.decode() + "\n")
    cfg = load_config(
        NodeConfig,
        env={"KVPOOL_CLUSTER_TOKEN_FILE": str(token_file)},
        overrides={"data_listen": "0.0.0.0:7400"},
    )
    assert cfg.security().token == TOKEN
    assert "***" in repr(cfg.security())
    assert TOKEN.decode() not in repr(cfg.security())


def test_token_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        read_token("short", "")
    with pytest.raises(ConfigError, match="printable ASCII"):
        read_token("a token with spaces in it", "")
    with pytest.raises(ConfigError, match="cannot read"):
        read_token("", "/nonexistent/kvpool-token")
    with pytest.raises(ConfigError, match="not both"):
        read_token(TOKEN.decode(), "/some/file")
    with pytest.raises(ConfigError, match="tls_cert_file/tls_key_file"):
        load_config(ClientConfig, env={}, overrides={"tls_cert_file": "/etc/hostname"})


def test_the_token_is_not_a_command_line_flag() -> None:
    import argparse

    from kvpool.cli.args import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser, NodeConfig)
    flags = {a for action in parser._actions for a in action.option_strings}
    assert "--cluster-token-file" in flags
    assert "--cluster-token" not in flags


def test_socket_left_unread_still_gets_the_refusal() -> None:
    """A stranger speaking something else entirely is answered and cut."""

    async def main() -> None:
        async with node(TOKEN) as server:
            loop = asyncio.get_running_loop()
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.setblocking(False)
            try:
                await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
                data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)
                assert data[:4] == b"KVPF"
            finally:
                sock.close()

    run(main())
