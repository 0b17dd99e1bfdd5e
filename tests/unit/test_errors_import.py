"""The error tree imports no transport: a process that only raises or catches kvpool errors
(and the light runtime modules beside them) does not pay for grpc at import; the gRPC status
of each class is still there, looked up when read."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from kvpool import errors

LIGHT = ["kvpool", "kvpool.errors", "kvpool.config", "kvpool.keys", "kvpool.units"]


@pytest.mark.parametrize("module", LIGHT)
def test_importing_a_light_module_does_not_import_grpc(module: str) -> None:
    code = f"import sys, {module}; assert 'grpc' not in sys.modules, 'grpc was imported'"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_every_error_class_names_a_grpc_status_on_the_class_and_the_instance() -> None:
    classes: list[type[errors.KVPoolError]] = [errors.KVPoolError, *errors.ERRORS_BY_CODE.values()]
    for cls in classes:
        assert isinstance(cls.grpc_status, grpc.StatusCode), cls
        assert cls().grpc_status is cls.grpc_status
    assert errors.NotLeaderError.grpc_status is grpc.StatusCode.FAILED_PRECONDITION
    assert errors.InvalidKeyError.grpc_status is grpc.StatusCode.INVALID_ARGUMENT  # inherited
    assert errors.InternalError.grpc_status is grpc.StatusCode.INTERNAL


def test_a_status_without_a_code_rebuilds_its_fallback_class() -> None:
    rebuild = errors.error_from_code
    assert type(rebuild(None, "m", status=grpc.StatusCode.UNIMPLEMENTED)) is (
        errors.ProtocolVersionError
    )
    assert type(rebuild(None, "m", status=grpc.StatusCode.CANCELLED)) is errors.UnavailableError
    assert type(rebuild(None, "m", status=grpc.StatusCode.ABORTED)) is errors.InternalError
    assert type(rebuild(None, "m")) is errors.InternalError
    assert type(rebuild("STALE_RING", "m", status=grpc.StatusCode.UNAVAILABLE)) is (
        errors.StaleRingError
    )
    leader = rebuild("NOT_LEADER", "m", leader="10.0.0.1:7300")
    assert isinstance(leader, errors.NotLeaderError)
    assert leader.leader == "10.0.0.1:7300"
