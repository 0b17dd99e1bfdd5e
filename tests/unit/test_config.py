"""Configuration: units, precedence (defaults < TOML < env < flags), every error named at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.config import (
    INDEX_ENTRY_BYTES,
    INDEX_MEMORY_FRACTION,
    ClientConfig,
    MasterConfig,
    NodeConfig,
    load_config,
    memory_limit_bytes,
    opt,
    physical_memory_bytes,
    redacted,
)
from kvpool.errors import ConfigError
from kvpool.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("256 MiB", 256 * 2**20),
        ("1.5g", int(1.5 * 2**30)),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        (123, 123),
    ],
)
def test_sizes_take_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "-1", True, -5])
def test_bad_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_durations_take_units() -> None:
    assert parse_duration("500ms") == pytest.approx(0.5)
    assert parse_duration("2s") == 2.0
    assert parse_duration("5m") == 300.0
    assert parse_duration(1.5) == 1.5
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_format_size_is_readable() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 2**30) == "3.0 GiB"


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "kvpool.toml"
    toml.write_text('[node]\ncpu_cache_size = "128MiB"\nzone = "rack-a"\nhigh_watermark = 0.9\n')
    env = {"KVPOOL_ZONE": "rack-b", "KVPOOL_LOW_WATERMARK": "0.5"}
    cfg = load_config(
        NodeConfig,
        toml_path=toml,
        section="node",
        env=env,
        overrides={"zone": "rack-c", "node_id": None},
    )
    assert cfg.cpu_cache_size == 128 * 2**20  # TOML over the default
    assert cfg.low_watermark == 0.5  # env over the default
    assert cfg.high_watermark == 0.9  # TOML, no env or flag
    assert cfg.zone == "rack-c"  # flag over env over TOML
    assert cfg.node_id == ""  # a None override is ignored


def test_every_problem_is_reported_at_once_with_its_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            NodeConfig,
            env={},
            overrides={
                "cpu_cache_size": "lots",
                "high_watermark": "very",
                "masters": "nowhere",
                "bogus_setting": 1,
            },
        )
    message = info.value.message
    for name in ("cpu_cache_size", "high_watermark", "bogus_setting"):
        assert name in message


def test_semantic_validation_names_the_setting() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            NodeConfig,
            env={},
            overrides={"low_watermark": 0.9, "high_watermark": 0.8, "masters": "nowhere"},
        )
    assert "low_watermark/high_watermark" in info.value.message
    assert "masters" in info.value.message


def test_unknown_toml_key_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('cpu_cache_sise = "1GiB"\n')
    with pytest.raises(ConfigError, match="cpu_cache_sise: unknown setting"):
        load_config(NodeConfig, toml_path=toml, env={})


def test_master_refuses_to_run_without_secret_or_persistence() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(MasterConfig, env={})
    assert "raft_secret" in info.value.message
    assert "data_dir" in info.value.message
    cfg = load_config(
        MasterConfig, env={"KVPOOL_RAFT_SECRET": "s3cret"}, overrides={"in_memory": True}
    )
    assert cfg.in_memory
    assert redacted(cfg)["raft_secret"] == "***"


def test_raft_runs_on_the_event_loop_wherever_the_index_has_a_data_dir(tmp_path: Path) -> None:
    env = {"KVPOOL_RAFT_SECRET": "s3cret"}
    in_memory = load_config(MasterConfig, env=env, overrides={"in_memory": True})
    assert in_memory.raft_tick_on_loop is None
    assert not in_memory.ticks_on_loop
    on_disk = load_config(MasterConfig, env=env, overrides={"data_dir": str(tmp_path)})
    assert on_disk.raft_tick_on_loop is None
    assert on_disk.ticks_on_loop
    with pytest.raises(ConfigError, match=r"raft_tick_on_loop: needs data_dir"):
        load_config(MasterConfig, env=env, overrides={"in_memory": True, "raft_tick_on_loop": True})
    disk = {"data_dir": str(tmp_path)}
    off = {**env, "KVPOOL_RAFT_TICK_ON_LOOP": "false"}
    assert not load_config(MasterConfig, env=off, overrides=disk).ticks_on_loop
    auto = {**env, "KVPOOL_RAFT_TICK_ON_LOOP": "auto"}
    assert load_config(MasterConfig, env=auto, overrides=disk).ticks_on_loop
    with pytest.raises(ConfigError, match=r"raft_tick_on_loop"):
        load_config(MasterConfig, env={**env, "KVPOOL_RAFT_TICK_ON_LOOP": "sometimes"})


def test_the_read_port_setting_takes_auto_off_or_an_address() -> None:
    env = {"KVPOOL_RAFT_SECRET": "s3cret"}
    base = {"in_memory": True}
    assert load_config(MasterConfig, env=env, overrides=base).read_listen == "auto"
    for ok in ("off", "127.0.0.1:7321", "[::1]:0"):
        assert load_config(MasterConfig, env=env, overrides={**base, "read_listen": ok})
    with pytest.raises(ConfigError, match=r"read_listen: not a host:port address"):
        load_config(MasterConfig, env=env, overrides={**base, "read_listen": "on"})
    # as the RPC port: no other host without the cluster token (it serves the index)
    with pytest.raises(ConfigError, match=r"read_listen: 10.1.0.5:7321 is not a loopback"):
        load_config(MasterConfig, env=env, overrides={**base, "read_listen": "10.1.0.5:7321"})


def test_node_tier_above_the_memory_share_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cpu_cache_size: .* of this machine's memory"):
        load_config(NodeConfig, env={}, overrides={"cpu_cache_size": "1024TiB"})


def test_client_config_checks_its_values() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ClientConfig, env={}, overrides={"replicas": 0, "timeout_s": 0, "masters": ""})
    for name in ("replicas", "timeout_s", "masters"):
        assert name in info.value.message


@pytest.mark.parametrize("bad", [-1, 10_001])
def test_a_client_busy_poll_outside_its_range_is_refused(bad: int) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ClientConfig, env={}, overrides={"busy_poll_us": bad})
    assert "busy_poll_us: must be between 0 and 10000" in info.value.message
    assert load_config(ClientConfig, env={}, overrides={"busy_poll_us": 300}).busy_poll_us == 300


def test_the_index_limit_is_given_or_taken_from_the_memory_a_master_may_use() -> None:
    env = {"KVPOOL_RAFT_SECRET": "s3cret"}
    given = load_config(
        MasterConfig, env=env, overrides={"in_memory": True, "index_max_entries": 5}
    )
    assert given.index_entry_limit() == 5
    auto = load_config(MasterConfig, env=env, overrides={"in_memory": True})
    assert auto.index_max_entries == 0
    expected = int(memory_limit_bytes() * INDEX_MEMORY_FRACTION) // INDEX_ENTRY_BYTES
    assert auto.index_entry_limit() == expected > 1_000_000
    with pytest.raises(ConfigError, match=r"index_max_entries"):
        load_config(MasterConfig, env=env, overrides={"in_memory": True, "index_max_entries": -1})


def test_a_container_memory_limit_below_the_machine_is_the_one_taken(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")  # cgroup v2 with no limit
    v1.write_text(f"{4 << 30}\n")
    assert memory_limit_bytes((str(v2),)) == physical_memory_bytes()
    assert memory_limit_bytes((str(v2), str(v1))) == min(4 << 30, physical_memory_bytes())
    assert memory_limit_bytes((str(tmp_path / "absent"),)) == physical_memory_bytes()


def test_a_node_tier_that_would_not_fit_its_container_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvpool.config as config

    def node(size: str) -> list[str]:
        return NodeConfig(cpu_cache_size=parse_size(size), masters=("127.0.0.1:7300",)).validate()

    monkeypatch.setattr(config, "physical_memory_bytes", lambda: 64 << 30)
    monkeypatch.setattr(config, "memory_limit_bytes", lambda: 2 << 30)  # dev overlay's pod
    assert not any("container" in e for e in node("1GiB"))
    (error,) = [e for e in node("1800MiB") if "container" in e]
    assert error.startswith("cpu_cache_size:")
    assert "2147483648 bytes" in error
    monkeypatch.setattr(config, "memory_limit_bytes", lambda: 9 << 30)  # the base's 8 GiB tier
    assert not any("container" in e for e in node("8GiB"))
    monkeypatch.setattr(config, "memory_limit_bytes", lambda: 64 << 30)  # no container limit
    assert not any("container" in e for e in node("40GiB"))


def test_a_settings_help_with_a_percent_sign_renders_in_help() -> None:
    """argparse formats help texts (``%(default)s``): a setting's help saying "90 %" once
    made ``kvpool master --help`` crash. Every config's flags render, and a ``%`` stays."""
    import argparse
    import dataclasses

    from kvpool.cli.args import add_config_flags

    @dataclasses.dataclass(frozen=True)
    class Odd:
        share: float = opt(0.9, "past 90 % of the limit (90%s of it, %(default)s)")

    for cls in (Odd, MasterConfig, NodeConfig, ClientConfig):
        parser = argparse.ArgumentParser(prog="kvpool")
        add_config_flags(parser, cls)
        text = parser.format_help()
        assert "--config" in text
    parser = argparse.ArgumentParser(prog="kvpool")
    add_config_flags(parser, Odd)
    assert "past 90 % of the limit (90%s of it, %(default)s)" in " ".join(
        parser.format_help().split()
    )
