"""kvpool's benchmarks, a distribution of their own (``kvpool-bench``) beside the package: what
is installed with kvpool is what its users run.

- :mod:`~kvpool_bench.cli` — the ``kvpool-bench`` command
- :mod:`~kvpool_bench.cluster` — a local cluster's latency, batches and failover; the index and
  the tiers (:mod:`~kvpool_bench.index`, :mod:`~kvpool_bench.tiers`)
- :mod:`~kvpool_bench.data_plane` — one store node's data server over loopback TCP
- :mod:`~kvpool_bench.client` — the data path through ``kvpool.Client``
- :mod:`~kvpool_bench.peers` — kvpool beside Redis and Mooncake Store (servers in
  :mod:`~kvpool_bench.peer_servers`, clients in :mod:`~kvpool_bench.worker` with
  :mod:`~kvpool_bench.drivers`, numbers in :mod:`~kvpool_bench.report`)
- :mod:`~kvpool_bench.engines` — inside SGLang's HiCache storage code
- :mod:`~kvpool_bench.replicas`, :mod:`~kvpool_bench.tracing` — hot replicas and repair;
  what tracing costs
"""
