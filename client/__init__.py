"""The kvpool client SDK (``kvpool.client``); engines use ``from kvpool import Client``.

* :mod:`~kvpool.client.sync` — :class:`Client`, the synchronous API, over a private loop thread
* :mod:`~kvpool.client.core` — :class:`ClientCore`, the one async implementation
* :mod:`~kvpool.client.blocks` — data-plane frames to store nodes (reads, stage, publish)
* :mod:`~kvpool.client.placement` — cached membership and the consistent-hash ring
* :mod:`~kvpool.client.values` — key, value and buffer checks (no copies)
* :mod:`~kvpool.client.stats` — hit/miss/put counters

Calls to the master group (leader discovery, redirects, retries) are the runtime's
:mod:`kvpool.mastercall`, shared with the store node.
"""
