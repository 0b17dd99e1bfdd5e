"""`kvpool node drain` is a subcommand of `kvpool node` (which, without an action, runs a node):
its help, its flags, and what it prints and returns as the masters answer (the masters scripted,
no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.cli import _parser, main
from kvpool.cli import node as node_cli
from kvpool.errors import KVPoolError, UnavailableError, UnknownMemberError
from kvpool.proto.v1 import master_pb2

Answer = master_pb2.DrainNodeResponse | KVPoolError


def _script(
    monkeypatch: pytest.MonkeyPatch, answers: list[Answer]
) -> list[tuple[str, master_pb2.DrainNodeRequest]]:
    asked: list[tuple[str, master_pb2.DrainNodeRequest]] = []

    def call(address: str, method: str, request: Any, timeout_s: float = 10.0) -> Any:
        assert method == "DrainNode"
        asked.append((address, request))
        answer = answers.pop(0)
        if isinstance(answer, KVPoolError):
            raise answer
        return answer

    monkeypatch.setattr(node_cli, "call_master", call)
    return asked


def test_drain_help_explains_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["node", "drain", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvpool node drain")
    for text in ("NODE_ID", "--masters", "--timeout", "--cancel", "leader is found", "[300]"):
        assert text in out


def test_node_help_lists_drain_and_a_node_run_still_parses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["node", "--help"])
    assert "drain" in capsys.readouterr().out
    args, unknown = _parser().parse_known_args(
        ["node", "--masters", "10.0.0.1:7300", "--cpu-cache-size", "1GiB"]
    )
    assert (args.node_command, args.masters, args.cpu_cache_size, unknown) == (
        None,
        "10.0.0.1:7300",
        "1GiB",
        [],
    )


def test_drain_without_masters_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["node", "drain", "node-1"])
    assert done.value.code == 2
    assert "kvpool node drain: error" in capsys.readouterr().err


def test_drain_follows_a_failing_master_and_waits_until_the_node_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = _script(
        monkeypatch,
        [
            UnavailableError("down"),
            master_pb2.DrainNodeResponse(blocks_left=3),
            master_pb2.DrainNodeResponse(blocks_left=0, left=True),
        ],
    )
    assert main(["node", "drain", "node-1", "--masters", "m1:1,m2:2", "--timeout", "30"]) == 0
    assert [a for a, _ in asked] == ["m1:1", "m2:2", "m1:1"]
    assert all(r.node_id == "node-1" and r.wait and not r.cancel for _, r in asked)
    out = capsys.readouterr().out
    assert "node node-1: 3 blocks left\n" in out
    assert "node node-1: 0 blocks left, left the cluster" in out
    assert "may be stopped now" in out


def test_a_node_gone_after_the_drain_was_taken_has_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(
        monkeypatch,
        [master_pb2.DrainNodeResponse(blocks_left=3), UnknownMemberError("no such member")],
    )
    assert main(["node", "drain", "node-1", "--masters", "m1:1"]) == 0
    assert "node node-1: left the cluster" in capsys.readouterr().out


def test_an_unknown_node_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(monkeypatch, [UnknownMemberError("no such member")])
    assert main(["node", "drain", "nobody", "--masters", "m1:1"]) == 1
    assert capsys.readouterr().err == "kvpool node drain: no such member\n"


def test_cancel_asks_once_and_reports_what_is_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = _script(monkeypatch, [master_pb2.DrainNodeResponse(blocks_left=7)])
    assert main(["node", "drain", "node-1", "--masters", "m1:1", "--cancel"]) == 0
    assert asked[0][1].cancel
    assert not asked[0][1].wait
    assert capsys.readouterr().out == "node node-1: drain cancelled, 7 blocks on it\n"


def test_a_drain_that_runs_out_of_time_fails_with_the_last_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(monkeypatch, [UnavailableError("no leader")] * 10)
    assert main(["node", "drain", "node-1", "--masters", "m1:1", "--timeout", "0.2"]) == 1
    assert capsys.readouterr().err == "kvpool node drain: not drained in time (no leader)\n"
