"""The kvpool store node (``kvpool node``): holds block bytes and serves them over the data plane.

- :mod:`~kvpool.store_node.allocator` — offsets over an arena (64-byte units, coalescing)
- :mod:`~kvpool.store_node.cpu_tier` — the ``Tier`` shape and the memfd-backed CPU tier
- :mod:`~kvpool.store_node.eviction` — eviction policies (``lru``) behind a name table
- :mod:`~kvpool.store_node.block_store` — the pure block table: stage, publish, get with
  leases, delete, watermark eviction, staged reaping
- :mod:`~kvpool.store_node.data_server` — ``tcp://`` frames in and out, payloads in place
- :mod:`~kvpool.store_node.registration` — register, heartbeat, report evictions, reap, leave
- :mod:`~kvpool.store_node.admin` — the ``NodeAdmin`` gRPC service (``GetStats``)
- :mod:`~kvpool.store_node.server` — process assembly: ``main(cfg) -> exit status``
- :mod:`~kvpool.store_node.bench` — the data-plane benchmark
"""
