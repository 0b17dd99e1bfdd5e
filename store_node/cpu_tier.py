"""Kept for imports written before the tiers package: the CPU tier lives in
:mod:`kvpool.store_node.tiers.cpu`, the ``Tier`` shape in :mod:`kvpool.store_node.tiers`."""

from kvpool.store_node.tiers import Tier
from kvpool.store_node.tiers.cpu import CpuTier

__all__ = ["CpuTier", "Tier"]
