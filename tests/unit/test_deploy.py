"""deploy/: the configuration the manifests and units ship is read by kvpool's own loader, their
flags are kvpool's flags, and the systemd units pass ``systemd-analyze verify``. (Manifest
schemas and yamllint: ``make deploy-check``, part of ``make lint``.)"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.cli import _parser
from kvpool.config import MasterConfig, NodeConfig, load_config
from kvpool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOKEN = "a-test-cluster-token-0123456789"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    token = tmp_path / "cluster-token"
    token.write_text(TOKEN + "\n")
    return {"KVPOOL_RAFT_SECRET": "s3cret", "KVPOOL_CLUSTER_TOKEN_FILE": str(token)}


# What the manifests pass as flags (pod addresses), and a CPU tier this machine can hold.
MASTER_FLAGS = {
    "listen": "10.1.0.5:7300",
    "rpc_listen": "10.1.0.5:7320",
    "advertise_address": "kvpool-master-0.kvpool-master.kvpool.svc.cluster.local:7300",
    "raft_listen": "kvpool-master-0.kvpool-master.kvpool.svc.cluster.local:7310",
    "raft_peers": "kvpool-master-1.kvpool-master:7310,kvpool-master-2.kvpool-master:7310",
}
NODE_FLAGS = {
    "node_id": "host-a",
    "listen": "10.1.0.9:7401",
    "data_listen": "10.1.0.9:7400",
    "cpu_cache_size": "256MiB",  # the file's size is for a production host, not this one
    "ssd_cache_size": "256MiB",
}


@pytest.mark.parametrize("path", ["k8s/base/kvpool.toml", "systemd/kvpool.toml"])
def test_shipped_toml_loads_with_kvpools_config_loader(path: str, env: dict[str, str]) -> None:
    toml = DEPLOY / path
    master = load_config(
        MasterConfig, toml_path=toml, section="master", env=env, overrides=MASTER_FLAGS
    )
    assert master.data_dir == "/var/lib/kvpool/master"
    assert master.security().token == TOKEN.encode()
    node = load_config(NodeConfig, toml_path=toml, section="node", env=env, overrides=NODE_FLAGS)
    assert len(node.masters) == 3
    assert node.ssd_cache_path == "/var/lib/kvpool/ssd"
    assert node.security().token == TOKEN.encode()


def test_the_loader_would_catch_a_misspelt_key(tmp_path: Path, env: dict[str, str]) -> None:
    bad = tmp_path / "kvpool.toml"
    text = (DEPLOY / "k8s/base/kvpool.toml").read_text()
    bad.write_text(text.replace("high_watermark", "high_watermarks"))
    with pytest.raises(ConfigError, match="high_watermarks: unknown setting"):
        load_config(NodeConfig, toml_path=bad, section="node", env=env, overrides=NODE_FLAGS)


def test_the_shipped_config_refuses_to_start_without_the_token() -> None:
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_config(
            NodeConfig,
            toml_path=DEPLOY / "k8s/base/kvpool.toml",
            section="node",
            env={},
            overrides=NODE_FLAGS,
        )


def _containers(manifest: str) -> dict[str, dict[str, Any]]:
    out = {}
    for doc in yaml.safe_load_all((DEPLOY / "k8s/base" / manifest).read_text()):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            out[c["name"]] = c
    return out


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[name]
    return chosen


def test_manifest_flags_are_kvpool_flags() -> None:
    node = _containers("node.yaml")["node"]
    assert node["args"][0] == "node"
    args = [re.sub(r"\$\((\w+)\)", "x", a) for a in node["args"][1:]]
    _subcommand("node").parse_args(args)  # exits (fails the test) on an unknown flag
    script = _containers("master.yaml")["master"]["args"][0]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", script))
    known = {s for a in _subcommand("master")._actions for s in a.option_strings}
    assert flags, "the master's start script names no flags"
    assert flags <= known, f"not flags of `kvpool master`: {sorted(flags - known)}"


def test_systemd_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here")
    kvpool = Path(sys.executable).parent / "kvpool"
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        # verify insists that ExecStart's program exists: point it at this environment's
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/kvpool/bin/kvpool", str(kvpool)))
        result = subprocess.run(
            [tool, "verify", str(copy)], capture_output=True, text=True, check=False, timeout=60
        )
        if result.returncode != 0 and "Failed to" in result.stderr and "bus" in result.stderr:
            pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()}")
        assert result.returncode == 0, f"{unit.name}: {result.stderr}"
        assert "kvpool" not in result.stderr, result.stderr  # no warnings about our unit
