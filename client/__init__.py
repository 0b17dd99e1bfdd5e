"""The kvpool client SDK (``kvpool.client``); engines use ``from kvpool import Client``.

* :mod:`~kvpool.client.sync` — :class:`Client`, the synchronous API, in the caller's thread
* :mod:`~kvpool.client.aio` — :class:`AsyncClient`, the same API on an event loop
* :mod:`~kvpool.client.api` — the public operations, each written once: it builds a job (a
  ReadCall, a Query or a put flow, with its failure policy) that the two drivers below carry out
* :mod:`~kvpool.client.state` — :class:`ClientState`: what a client knows and decides, no I/O
* :mod:`~kvpool.client.fastpath` — the blocking driver; :mod:`~kvpool.client.core` — the
  event-loop driver
* :mod:`~kvpool.client.ops` and :mod:`~kvpool.client.plans` — the read and put flows and the
  pure decisions under them (which replica, what goes again, what a frame means)
* :mod:`~kvpool.client.blocking_plane`, :mod:`~kvpool.client.blocks` — the data planes (frames
  to store nodes: reads, stage, publish), blocking and awaited
* :mod:`~kvpool.client.placement` — cached membership and the consistent-hash ring
* :mod:`~kvpool.client.values` — key, value and buffer checks (no copies)
* :mod:`~kvpool.client.stats` — hit/miss/put counters
* :mod:`~kvpool.client.pause` — an engine backend's pause after the store failed
  (``retry_after_s``), shared by every backend

Calls to the master group (leader discovery, redirects, retries) are the runtime's
:mod:`kvpool.mastercall`, shared with the store node. ``docs/client.md`` walks through it.
"""
