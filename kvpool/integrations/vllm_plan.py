"""The scheduler side of the vLLM connector as a pure object: requests in, per-step plans out.

vLLM's scheduler asks the connector how many tokens of a request the store holds, tells it
which blocks it allocated, and builds one metadata object per step for the workers. This
module decides all of that with no vLLM import, no socket and no clock: the store is asked
through the ``prefix_match`` callable it is given, and every answer is a plain value, so the
unit tests replay exact sequences of scheduler events.

* **match** — a prompt's full blocks before its last token (vLLM always computes the last
  one) are hashed and asked for in one ``prefix_match``; the leading blocks held whole, beyond
  what vLLM's own prefix cache already has, are offered to vLLM. A failed store answers 0 and
  is not asked again for ``retry_after_s``.
* **load** — once vLLM allocated the blocks, the next step's plan names them (vLLM block ids
  and their hashes) for the workers to read into.
* **save** — every step, the blocks a request completed in that step (prompt and generated
  tokens; only tokens already known, so a block never holds a draft or placeholder token)
  are named for the workers to write, once each, skipping those the store already had.
* **finish** — a request that had saves is held (its blocks stay allocated) until the workers
  report its saves done: saves send straight from vLLM's memory, so a block must not be reused
  before it has been sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.client.pause import StorePause
from kvpool.errors import KVPoolError
from kvpool.integrations.vllm_blocks import HashChain, PagedLayout

MAX_MATCH_KEYS = 8192
"""Keys asked in one prefix match (a longer prompt is asked in runs of this many)."""


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to move in one step: where they are in vLLM's cache (block ids)
    and what they are (their hashes, one tuple per tensor-parallel rank)."""

    req_id: str
    first_block: int
    """The index of the first block in the request (0 = its first ``block_size`` tokens)."""
    block_ids: tuple[int, ...]
    hashes: tuple[tuple[bytes, ...], ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the workers do in one step."""

    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    held: tuple[str, ...] = ()
    """Finished requests whose blocks vLLM keeps until the workers report their saves done."""
    preempted: tuple[str, ...] = ()
    """Requests whose blocks vLLM just freed: their pending saves must finish first."""


@dataclass
class _Request:
    req_id: str
    tokens: Sequence[int]
    """The request's tokens (vLLM's live list: prompt, then accepted output tokens)."""
    prompt_len: int
    chain: HashChain
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0
    """Leading blocks the store has or that were already sent for saving."""
    asked: tuple[int, int] | None = None
    """(tokens vLLM had computed, tokens offered) of the last match."""
    load: tuple[int, int] | None = None
    """Blocks [start, stop) to load in the request's next scheduled step."""
    saving: bool = False
    """A save was planned for it (so it is held at finish)."""


@dataclass
class PlannerTotals:
    matches: int = 0
    matched_tokens: int = 0
    loads: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    store_failures: int = 0


class SchedulerPlanner:
    """Decides loads and saves for one engine; see the module doc."""

    def __init__(
        self,
        layout: PagedLayout,
        prefix_match: Callable[[list[str]], int],
        *,
        load: bool,
        save: bool,
        retry_after_s: float,
        clock: Callable[[], float],
        on_store_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.layout = layout
        self._prefix_match = prefix_match
        self.load_enabled = load
        self.save_enabled = save
        self._on_failure = on_store_failure
        self._pause = StorePause(retry_after_s, clock)
        self._requests: dict[str, _Request] = {}
        self._final_saves: list[BlockTransfer] = []
        self._held: list[str] = []
        self.totals = PlannerTotals()

    # --- the store ----------------------------------------------------------------------------

    def paused(self) -> bool:
        return self._pause.paused()

    def _failed(self, error: KVPoolError) -> None:
        self._pause.failed()
        self.totals.store_failures += 1
        if self._on_failure is not None:
            self._on_failure(f"{type(error).__name__}: {error.message}")

    def _stored_blocks(self, req: _Request, blocks: int) -> int | None:
        """Leading blocks of ``req`` (of its first ``blocks``) the store holds whole, or None
        when the store failed."""
        layout = self.layout
        req.chain.extend(req.tokens, blocks)
        per_call = max(1, MAX_MATCH_KEYS // layout.keys_per_block)
        held = 0
        try:
            while held < blocks:
                stop = min(blocks, held + per_call)
                keys = layout.match_keys(req.chain.chains, held, stop)
                whole = layout.whole_blocks(self._prefix_match(keys))
                held += whole
                if held < stop:
                    break
        except KVPoolError as e:
            self._failed(e)
            return None
        return held

    # --- vLLM's scheduler calls -------------------------------------------------------------

    def track(self, req_id: str, tokens: Sequence[int], prompt_len: int) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            req = _Request(req_id, tokens, prompt_len, HashChain(self.layout))
            self._requests[req_id] = req
        else:
            req.tokens = tokens
        return req

    def match(self, req_id: str, tokens: Sequence[int], prompt_len: int, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` (vLLM's own prefix-cache hit) the store can give."""
        req = self.track(req_id, tokens, prompt_len)
        if req.asked is not None and req.asked[0] == num_computed:
            return req.asked[1]  # asked again for a request still waiting: the same answer
        size = self.layout.block_size
        usable = max(0, prompt_len - 1) // size  # the last prompt token is always computed
        offered = 0
        if (self.load_enabled or self.save_enabled) and usable and not self.paused():
            held = self._stored_blocks(req, usable)
            if held is not None:
                req.stored = max(req.stored, held)
                if self.load_enabled:
                    offered = max(0, held * size - num_computed)
        self.totals.matches += 1
        self.totals.matched_tokens += offered
        req.asked = (num_computed, offered)
        return offered

    def allocated(self, req_id: str, num_external: int) -> None:
        """vLLM allocated blocks for ``num_external`` tokens of the store's (0: none)."""
        req = self._requests.get(req_id)
        if req is None or num_external <= 0 or req.asked is None:
            return
        size = self.layout.block_size
        start = req.asked[0] // size
        req.load = (start, start + num_external // size)

    def scheduled(
        self,
        req_id: str,
        *,
        block_ids: Sequence[int] | None,
        replace_blocks: bool,
        num_computed: int,
        num_scheduled: int,
        loads: list[BlockTransfer],
        saves: list[BlockTransfer],
    ) -> None:
        """A request runs in this step: ``block_ids`` are all its blocks (``replace_blocks``:
        a new or resumed request) or the ones added (None: none added)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if replace_blocks:
            req.block_ids = list(block_ids or ())
        elif block_ids:
            req.block_ids.extend(block_ids)
        req.asked = None
        if req.load is not None:
            start, stop = req.load
            req.load = None
            stop = min(stop, len(req.block_ids))
            if stop > start:
                req.chain.extend(req.tokens, stop)
                loads.append(
                    BlockTransfer(
                        req_id, start, tuple(req.block_ids[start:stop]), req.chain.span(start, stop)
                    )
                )
                self.totals.loads += 1
                self.totals.loaded_blocks += stop - start
        self._plan_save(req, num_computed + num_scheduled, saves)

    def _plan_save(self, req: _Request, computed: int, saves: list[BlockTransfer]) -> None:
        if not self.save_enabled or self.paused():
            return
        size = self.layout.block_size
        full = min(computed, len(req.tokens), len(req.block_ids) * size) // size
        if full <= req.stored:
            return
        start = req.stored
        req.chain.extend(req.tokens, full)
        saves.append(
            BlockTransfer(
                req.req_id, start, tuple(req.block_ids[start:full]), req.chain.span(start, full)
            )
        )
        req.stored = full
        req.saving = True
        self.totals.saved_blocks += full - start

    def preempted(self, req_id: str) -> None:
        """vLLM freed the request's blocks (it may be scheduled again later)."""
        req = self._requests.get(req_id)
        if req is not None:
            req.block_ids = []
            req.load = None
            req.asked = None

    def finished(self, req_id: str, block_ids: Sequence[int], num_computed: int) -> bool:
        """The request is done; True when vLLM must keep its blocks until the workers report
        its saves done (a last save, if any, goes with the next step's plan)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return False
        req.block_ids = list(block_ids)
        final: list[BlockTransfer] = []
        self._plan_save(req, num_computed, final)
        self._final_saves.extend(final)
        if req.saving:
            self._held.append(req_id)
        return req.saving

    def step(
        self, loads: list[BlockTransfer], saves: list[BlockTransfer], preempted: Sequence[str]
    ) -> StepPlan:
        """This step's plan: the loads and saves collected by :meth:`scheduled`, the last
        saves of requests finished since the previous step, and the requests to hold."""
        saves = self._final_saves + saves
        held = tuple(self._held)
        self._final_saves = []
        self._held = []
        return StepPlan(
            loads=tuple(loads), saves=tuple(saves), held=held, preempted=tuple(preempted)
        )

    @property
    def tracked(self) -> int:
        return len(self._requests)
