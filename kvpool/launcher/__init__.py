"""Starting kvpool processes on this host: a whole local cluster (``kvpool cluster up``, the
demo, the tests, the chaos harness) and probing what they report. Spawns ``python -m kvpool``
children; imports neither the master nor the store node."""
