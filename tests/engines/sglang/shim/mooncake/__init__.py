"""``mooncake`` for SGLang's own Mooncake code, pointing at kvpool (tests/engines/sglang).

With this folder first on ``PYTHONPATH``, ``from mooncake.store import MooncakeDistributedStore``
in SGLang's unmodified ``mooncake_store.py`` and its ``test_mooncake_store.py`` gets
:class:`kvpool.compat.mooncake.MooncakeDistributedStore`: the way a user points an engine's
Mooncake backend at a kvpool cluster without touching the engine.
"""
