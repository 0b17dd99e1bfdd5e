"""kvpool's wire contract: the gRPC/protobuf messages (``v1``), the data-plane frame header
(``wire``) and the consistent-hash ring (``ring``) — everything two processes must agree on byte
for byte. Nothing here does I/O."""

PROTOCOL_VERSION = 1
"""Version of the whole kvpool protocol (gRPC metadata and data-plane frames). Bumped on any
incompatible change; a peer speaking another version is refused with both versions named."""
