"""The kvpool master: a Raft-replicated block index (PySyncObj) behind the ``kvpool.v1.Master``
gRPC service.

- :mod:`~kvpool.raft_master.commands`: the replicated commands, their results and encoding;
- :mod:`~kvpool.raft_master.index`: the pure, deterministic state machine (``BlockIndex``);
- :mod:`~kvpool.raft_master.records`: its data layouts and the snapshot format;
- :mod:`~kvpool.raft_master.replication`: the PySyncObj adapter (``Replicator``);
- :mod:`~kvpool.raft_master.group_commit`: merging concurrent CommitPuts into one Raft entry;
- :mod:`~kvpool.raft_master.service`: the gRPC servicer;
- :mod:`~kvpool.raft_master.failure`: failure detection on the leader;
- :mod:`~kvpool.raft_master.server`: the process (``main(cfg)``);
- :mod:`~kvpool.raft_master.local_group`: a group of master processes for tests and demos.
"""
