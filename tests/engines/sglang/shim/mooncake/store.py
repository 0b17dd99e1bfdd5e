"""``mooncake.store`` → :mod:`kvpool.compat.mooncake` (see the package doc)."""

from kvpool.compat.mooncake import *  # noqa: F403 - the whole Mooncake API, re-exported
from kvpool.compat.mooncake import BufferHandle, MooncakeDistributedStore, ReplicateConfig

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig"]
