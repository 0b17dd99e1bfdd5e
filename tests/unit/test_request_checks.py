"""RegisterNode validation and the bound on read sizes (issue 16, findings 6 and 7)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.errors import MalformedRequestError, RequestTooLargeError
from kvpool.proto.v1 import master_pb2
from kvpool.raft_master.request_checks import check_key_count, check_registration

GOOD: dict[str, Any] = {
    "node_id": "node-1",
    "incarnation": 7,
    "data_address": "tcp://10.0.0.7:7400",
    "admin_address": "10.0.0.7:7401",
    "capacity_bytes": 1 << 30,
    "zone": "rack-a",
}


def test_a_well_formed_registration_passes() -> None:
    check_registration(master_pb2.RegisterNodeRequest(**GOOD), 1 << 50)
    check_registration(
        master_pb2.RegisterNodeRequest(
            **{**GOOD, "data_address": "inproc://n1", "admin_address": ""}
        ),
        1 << 50,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data_address", "not-an-address"),
        ("data_address", "tcp://host"),
        ("data_address", "tcp://host:0"),
        ("data_address", "tcp://host:99999"),
        ("data_address", "http://host:80"),
        ("data_address", "tcp://ho st:1"),
        ("data_address", ""),
        ("admin_address", "nowhere"),
        ("capacity_bytes", 2**64 - 1),
        ("capacity_bytes", 0),
        ("node_id", ""),
        ("node_id", "x" * 300),
        ("node_id", "a\nb"),
        ("incarnation", 0),
        ("zone", "z" * 100),
    ],
)
def test_every_field_of_a_registration_is_checked(field: str, value: object) -> None:
    request = master_pb2.RegisterNodeRequest(**{**GOOD, field: value})
    with pytest.raises(MalformedRequestError):
        check_registration(request, 1 << 50)


def test_reads_of_too_many_keys_are_refused_with_a_typed_error() -> None:
    check_key_count(16384, 16384, "Lookup")
    with pytest.raises(RequestTooLargeError, match="at most 16384"):
        check_key_count(10**6, 16384, "Lookup")
