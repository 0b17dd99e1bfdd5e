"""Work the pure tier manager hands to the tier worker (the I/O shell), and nothing else.

Each job names the copies it reads and fills. Source copies are leased for the job's duration
(never freed or overwritten under it); destination copies are allocated but not yet readable.
The worker performs the job on a thread and reports back (``finish_*`` on the block store); the
manager then attaches the new copies — or frees them if the block left meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.store_node.blocks import Copy
from kvpool.store_node.tiers.manifest import Record


@dataclass(slots=True, eq=False)
class Demotion:
    """One block leaving a fast tier for the SSD: ``source`` is leased, ``dest`` not ready."""

    source: Copy
    dest: Copy


@dataclass(slots=True, eq=False)
class WriteJob:
    """Demotions into one contiguous, aligned SSD extent ``[start, start + length)``, written
    with one large write; ``records`` (segment openings) go to the manifest first, the blocks'
    LAND records after the write."""

    segment: int
    generation: int
    start: int
    length: int
    items: list[Demotion] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class CopyJob:
    """A promotion between memory tiers (CPU → GPU): copy ``source`` into ``dest``."""

    source: Copy
    dest: Copy


@dataclass(slots=True, eq=False)
class ManifestJob:
    """Manifest records with no write of their own (blocks leaving the SSD)."""

    records: list[Record]


Job = WriteJob | CopyJob | ManifestJob
