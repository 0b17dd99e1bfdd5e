"""``python -m kvpool_bench``: the same as the ``kvpool-bench`` command."""

import sys

from kvpool_bench.cli import main

sys.exit(main())
