"""Drop-in APIs of other KV stores on top of kvpool.

* :mod:`~kvpool.compat.mooncake` — ``MooncakeDistributedStore``: Mooncake Store's Python API
  (method names, arguments, return codes) over a kvpool cluster; see ``docs/mooncake.md``.
"""
