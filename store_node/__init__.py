"""The kvpool store node (``kvpool node``): holds block bytes in tiers and serves them.

- :mod:`~kvpool.store_node.tiers` — the tiers: CPU (memfd arena), SSD (preallocated file in
  append-only segments, manifest), GPU (cupy, optional)
- :mod:`~kvpool.store_node.allocator` — offsets over an arena (aligned units, coalescing)
- :mod:`~kvpool.store_node.eviction` — eviction policies (``s3fifo``, ``lru``) behind a name table
- :mod:`~kvpool.store_node.blocks` — block and copy records, results handed out by the core
- :mod:`~kvpool.store_node.block_store` — the pure block table: stage, publish, get with
  leases, delete, staged reaping, reports for the index
- :mod:`~kvpool.store_node.tier_manager` — the pure tier logic: watermarks, eviction,
  demotion to SSD, promotion, segment reclaim; hands out :mod:`~kvpool.store_node.jobs`
- :mod:`~kvpool.store_node.tier_worker` — the I/O shell: runs jobs and slow-tier reads on threads
- :mod:`~kvpool.store_node.warm_restart` — finds the SSD tier's blocks again after a restart
- :mod:`~kvpool.store_node.data_server` — ``tcp://`` frames in and out, payloads in place
- :mod:`~kvpool.store_node.registration` — register, heartbeat, report evictions and tiers,
  claim SSD blocks after a restart, reap, leave
- :mod:`~kvpool.store_node.admin` — the ``NodeAdmin`` gRPC service (``GetStats``)
- :mod:`~kvpool.store_node.replicate` — node-to-node block copies for replicas (``CopyBlocks``)
- :mod:`~kvpool.store_node.server` — process assembly: ``main(cfg) -> exit status``
- :mod:`~kvpool.store_node.gpu_check` — the GPU checks, for a machine with a GPU
"""
