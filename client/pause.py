"""How a backend embedded in an engine leaves a failed store alone: after a call found the
store down or too slow, it is not asked again for ``retry_after_s``, so that the engine's
requests answer a miss at once instead of each waiting out the deadline on a dead store. One
mechanism for every backend (kvpool's demo engine, vLLM's scheduler and workers, SGLang,
LMCache); each decides which of its calls it holds back."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpool.errors import DeadlineExceededError, UnavailableError

STORE_DOWN = (UnavailableError, DeadlineExceededError)
"""The failures that say the store itself is unreachable or too slow (no master answered, no
answer within the deadline), as opposed to a miss or a bad request."""


class StorePause:
    """After the store failed, it is left alone for ``retry_after_s`` (0: never paused).
    Thread-safe enough for engines' storage threads: one float, written whole."""

    def __init__(self, retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._until = 0.0
        self.pauses = 0

    def paused(self) -> bool:
        return self._clock() < self._until

    def failed(self) -> None:
        if self.retry_after_s > 0:
            self._until = self._clock() + self.retry_after_s
            self.pauses += 1
