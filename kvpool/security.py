"""Cluster security settings: the cluster token, TLS files, and the loopback-only rule.

* **Cluster token** — a shared secret every kvpool process of one cluster knows. A master
  requires it on every kvpool gRPC call (node registration included: gRPC metadata
  ``kvpool-cluster-token``) and on every connection to its frame RPC port; a store node on every
  data-plane connection (TCP, in-process and the shared-memory socket that hands out the arena):
  the connection's first frame is ``AUTH`` with the token (:mod:`kvpool.transports.auth`), checked
  once per connection, never per frame. Compared in constant time; never logged.
* **TLS** — gRPC servers (masters, the node's admin service) serve TLS when given a certificate
  and key, and require client certificates signed by ``tls_ca_file`` with ``tls_client_auth``;
  channels (clients, nodes calling masters) verify the servers against ``tls_ca_file`` and present
  their own certificate when they have one. The data plane (block bytes) is not encrypted: keep it
  on a trusted network; the token keeps strangers off it.
* **Loopback only by default** — without a cluster token a process refuses to listen on anything
  but a loopback address (:func:`bind_problems`): an unauthenticated kvpool on a reachable
  address would let anyone read and overwrite cached blocks.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import ConfigError

TOKEN_METADATA_KEY = "kvpool-cluster-token"  # noqa: S105 - a metadata key, not a secret
MIN_TOKEN_CHARS = 16
MAX_TOKEN_BYTES = 1024


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one process. A server uses ``cert_file``/``key_file`` (and ``ca_file`` to
    check client certificates when ``client_auth``); a channel uses ``ca_file`` to check the
    server and ``cert_file``/``key_file`` as its client certificate when both are set."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    client_auth: bool = False
    server_name: str = ""

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file and self.key_file)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca_file)

    def read(self, name: str) -> bytes | None:
        """The bytes of ``cert_file``, ``key_file`` or ``ca_file`` (None when unset);
        ConfigError when unreadable."""
        path = getattr(self, name)
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"tls_{name}: cannot read {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Security:
    """What a process proves and checks: the cluster token (``b""``: none) and its TLS files."""

    token: bytes = b""
    tls: TlsFiles = TlsFiles()

    def __repr__(self) -> str:  # never print the token
        return f"Security(token={'***' if self.token else 'unset'}, tls={self.tls!r})"

    @property
    def token_text(self) -> str:
        return self.token.decode("ascii")


NO_SECURITY = Security()


def env_security(env: Mapping[str, str] | None = None) -> Security:
    """The security settings a tool takes from the environment (as every kvpool process
    does): ``KVPOOL_CLUSTER_TOKEN`` or ``KVPOOL_CLUSTER_TOKEN_FILE``, ``KVPOOL_TLS_CA_FILE``,
    ``KVPOOL_TLS_CERT_FILE``, ``KVPOOL_TLS_KEY_FILE``, ``KVPOOL_TLS_SERVER_NAME``."""
    env = os.environ if env is None else env
    return Security(
        token=read_token(
            env.get("KVPOOL_CLUSTER_TOKEN", ""), env.get("KVPOOL_CLUSTER_TOKEN_FILE", "")
        ),
        tls=TlsFiles(
            cert_file=env.get("KVPOOL_TLS_CERT_FILE", ""),
            key_file=env.get("KVPOOL_TLS_KEY_FILE", ""),
            ca_file=env.get("KVPOOL_TLS_CA_FILE", ""),
            server_name=env.get("KVPOOL_TLS_SERVER_NAME", ""),
        ),
    )


def check_token(token: str) -> str | None:
    """Why ``token`` cannot be a cluster token, or None. Printable ASCII without spaces (it
    travels in gRPC metadata), at least MIN_TOKEN_CHARS characters."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"must be at least {MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)"
    if len(token) > MAX_TOKEN_BYTES:
        return f"must be at most {MAX_TOKEN_BYTES} characters"
    if not all(33 <= ord(c) <= 126 for c in token):
        return "must be printable ASCII without spaces"
    return None


def read_token(token: str, token_file: str) -> bytes:
    """The cluster token from the setting or the first line of ``token_file`` (not both);
    ``b""`` when neither is set. Raises ConfigError naming the setting, never the token."""
    if token and token_file:
        raise ConfigError("cluster_token/cluster_token_file: set one of them, not both")
    source = "cluster_token"
    if token_file:
        source = "cluster_token_file"
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cluster_token_file: cannot read {token_file}: {e}") from None
        lines = text.splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise ConfigError(f"cluster_token_file: {token_file} is empty")
    if not token:
        return b""
    problem = check_token(token)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return token.encode("ascii")


def tokens_equal(expected: bytes, offered: bytes | bytearray | memoryview) -> bool:
    """Constant-time comparison (the time does not tell how much of a guess was right)."""
    return hmac.compare_digest(expected, bytes(offered))


def is_loopback_host(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def bind_problems(addresses: dict[str, str], token_set: bool) -> list[str]:
    """Each setting in ``addresses`` (name → ``host:port``) that would listen beyond loopback
    without a cluster token, with why and what to configure."""
    if token_set:
        return []
    problems = []
    for name, address in addresses.items():
        host = address.rpartition(":")[0].strip("[]")
        if host and not is_loopback_host(host):
            problems.append(
                f"{name}: {address} is not a loopback address, and no cluster token is set: "
                "anyone who can reach it could read and overwrite cached blocks. Set "
                "cluster_token_file (or KVPOOL_CLUSTER_TOKEN) on every master, node and "
                "client of the cluster, and preferably TLS (tls_cert_file, tls_key_file, "
                "tls_ca_file); or listen on 127.0.0.1"
            )
    return problems
