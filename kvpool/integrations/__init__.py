"""Engine backends: kvpool behind each inference engine's own storage interface.

The module paths below are what engine configurations name, so they stay stable once shipped:

* ``kvpool.integrations.sglang`` — ``KVPoolHiCacheStorage``, an SGLang HiCache storage backend
  (``--hicache-storage-backend dynamic``).
* ``kvpool.integrations.vllm`` — ``KVPoolConnector``, a vLLM ``KVConnectorBase_V1``
  (``kv_connector_module_path="kvpool.integrations.vllm"``).
* ``kvpool.integrations.lmcache`` — ``KVPoolConnectorAdapter``, an LMCache remote-storage plugin.

Importing this package imports no engine; each module imports its engine's classes itself and
fails with a clear error naming the missing package when the engine is not installed.
"""
