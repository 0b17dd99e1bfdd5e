"""The vLLM connector's pure parts, with no vLLM: settings, block <-> key mapping, and the
scheduler's plans for sequences of vLLM's scheduler events."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError, UnavailableError
from kvpool.integrations.settings import read_settings
from kvpool.integrations.vllm_blocks import HashChain, PagedLayout, paged_layout
from kvpool.integrations.vllm_plan import BlockTransfer, SchedulerPlanner
from kvpool.keys import block_keys

BS = 4


def layout(layers: int = 2, tp: int = 1, **changes: object) -> PagedLayout:
    fields: dict[str, object] = {
        "model": "m",
        "revision": "",
        "dtype": "torch.bfloat16",
        "block_size": BS,
        "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        "page_bytes": 64,
        "physical_layout": "LBHNC:NONE",
        "page_shape": (2, BS, 8, 8),
        "tp_size": tp,
    }
    fields.update(changes)
    return paged_layout(**fields)  # type: ignore[arg-type]


class Store:
    """prefix_match over a set of keys, with a switch that makes it fail."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.calls: list[list[str]] = []
        self.down = False

    def prefix_match(self, keys: list[str]) -> int:
        self.calls.append(keys)
        if self.down:
            raise UnavailableError("no master answered")
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def hold(self, lay: PagedLayout, tokens: list[int], blocks: int, *, rank: int = 0) -> None:
        chain = HashChain(lay)
        chain.extend(tokens, blocks)
        for h in chain.chains[rank][:blocks]:
            self.keys.update(lay.block_keys(rank, h))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def planner(
    lay: PagedLayout, store: Store, *, load: bool = True, save: bool = True
) -> tuple[SchedulerPlanner, Clock]:
    clock = Clock()
    return (
        SchedulerPlanner(
            lay, store.prefix_match, load=load, save=save, retry_after_s=5.0, clock=clock
        ),
        clock,
    )


# --- settings --------------------------------------------------------------------------------


def test_settings_take_masters_as_a_list_or_a_string_and_refuse_unknown_names() -> None:
    a = read_settings({"masters": "h1:1,h2:2"}, where="cfg")
    b = read_settings({"masters": ["h1:1", "h2:2"], "timeout_s": "0.5"}, where="cfg")
    assert a.masters == b.masters == ("h1:1", "h2:2")
    assert b.timeout_s == 0.5
    with pytest.raises(ConfigError, match=r"cfg\['mastrs'\]: unknown setting"):
        read_settings({"mastrs": "h:1"}, where="cfg")
    with pytest.raises(ConfigError, match=r"cfg\['masters'\]: required"):
        read_settings({}, where="cfg")
    with pytest.raises(ConfigError, match=r"cfg\['masters'\]: 'nohost' is not host:port"):
        read_settings({"masters": "nohost"}, where="cfg")
    with pytest.raises(ConfigError, match=r"cfg\['timeout_s'\]: must be a positive"):
        read_settings({"masters": "h:1", "timeout_s": 0}, where="cfg")
    with pytest.raises(ConfigError, match=r"cfg\['block_size'\]: expected an integer"):
        read_settings(
            {"masters": "h:1", "block_size": "x"}, where="cfg", extra_kinds={"block_size": "int"}
        )
    assert read_settings({}, where="cfg", masters="h:9").masters == ("h:9",)


# --- keys --------------------------------------------------------------------------------


def test_a_pages_key_is_the_blocks_docs_keys_md_key_and_its_layer() -> None:
    lay = layout()
    tokens = list(range(10))
    chain = HashChain(lay)
    chain.extend(tokens, 2)
    expected = block_keys(lay.namespaces[0], tokens)
    assert [lay.block_keys(0, h) for h in chain.chains[0]] == [
        [f"{k}/0", f"{k}/1"] for k in expected
    ]


def test_hash_chains_grow_block_by_block_to_the_same_keys() -> None:
    lay = layout()
    tokens = list(range(40))
    grown = HashChain(lay)
    for blocks in (1, 3, 3, 7, 10):
        grown.extend(tokens, blocks)
    whole = HashChain(lay)
    whole.extend(tokens, 10)
    assert grown.chains == whole.chains


def test_namespaces_split_ranks_dtypes_layouts_and_block_sizes() -> None:
    base = layout(tp=2)
    assert base.namespaces[0].fingerprint != base.namespaces[1].fingerprint
    others = [
        layout(dtype="float16"),
        layout(physical_layout="BLHNC:NONE"),
        layout(page_shape=(4, BS, 8, 8)),
        layout(layers=3),
        layout(model="other"),
        layout(extra="load_format=dummy"),
    ]
    prints = {lay.namespaces[0].fingerprint for lay in [layout(), *others]}
    assert len(prints) == 1 + len(others)
    # bf16 spelled by torch or by us is one dtype
    assert layout(dtype="bfloat16").namespaces[0] == layout().namespaces[0]


def test_match_keys_interleave_ranks_and_layers_so_a_count_is_whole_blocks() -> None:
    lay = layout(layers=3, tp=2)
    chain = HashChain(lay)
    chain.extend(list(range(12)), 3)
    keys = lay.match_keys(chain.chains, 0, 3)
    assert len(keys) == 3 * 3 * 2
    assert keys[:3] == lay.block_keys(0, chain.chains[0][0])
    assert keys[3:6] == lay.block_keys(1, chain.chains[1][0])
    assert [lay.whole_blocks(n) for n in (0, 5, 6, 11, 12, 18)] == [0, 0, 1, 1, 2, 3]


# --- the scheduler -----------------------------------------------------------------------


def test_match_offers_whole_blocks_beyond_vllms_own_hit_never_the_last_token() -> None:
    lay, store = layout(), Store()
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks before the last token
    store.hold(lay, tokens, 3)
    plan, _ = planner(lay, store)
    assert plan.match("r", tokens, len(tokens), 0) == 12
    plan2, _ = planner(lay, store)
    assert plan2.match("r", tokens, len(tokens), 4) == 8  # vLLM had block 0 itself
    exact = tokens[:12]  # 12 tokens: the third block holds the last token
    plan3, _ = planner(lay, store)
    assert plan3.match("r", exact, len(exact), 0) == 8


def test_a_block_missing_one_layer_ends_the_match() -> None:
    lay, store = layout(), Store()
    tokens = list(range(17))
    store.hold(lay, tokens, 4)
    chain = HashChain(lay)
    chain.extend(tokens, 4)
    store.keys.discard(lay.key(0, chain.chains[0][2], 1))
    plan, _ = planner(lay, store)
    assert plan.match("r", tokens, len(tokens), 0) == 2 * BS


def test_match_is_asked_once_per_wait_and_a_failed_store_is_left_alone() -> None:
    lay, store = layout(), Store()
    tokens = list(range(9))
    store.hold(lay, tokens, 2)
    plan, clock = planner(lay, store)
    assert plan.match("r", tokens, 9, 0) == 8
    assert plan.match("r", tokens, 9, 0) == 8
    assert len(store.calls) == 1
    store.down = True
    assert plan.match("s", tokens, 9, 0) == 0
    assert plan.paused()
    assert plan.match("t", tokens, 9, 0) == 0
    assert len(store.calls) == 2  # t was not asked: the store failed just now
    store.down = False
    clock.now += 5.0
    assert plan.match("u", tokens, 9, 0) == 8


def test_a_load_is_planned_for_the_allocated_blocks_of_the_next_step() -> None:
    lay, store = layout(), Store()
    tokens = list(range(14))
    store.hold(lay, tokens, 3)
    plan, _ = planner(lay, store)
    assert plan.match("r", tokens, 14, 4) == 8
    plan.allocated("r", 8)
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    plan.scheduled("r", block_ids=[7, 8, 9, 10], replace_blocks=True, num_computed=12,
                   num_scheduled=2, loads=loads, saves=saves)  # fmt: skip
    step = plan.step(loads, saves, [])
    (load,) = step.loads
    assert (load.req_id, load.first_block, load.block_ids) == ("r", 1, (8, 9))
    chain = HashChain(lay)
    chain.extend(tokens, 3)
    assert load.hashes == (tuple(chain.chains[0][1:3]),)
    assert step.saves == ()  # 14 computed tokens: block 3 is not full yet; 0-2 are stored


def test_saves_name_each_block_once_when_it_is_full_and_its_tokens_known() -> None:
    lay, store = layout(), Store()
    tokens = list(range(10))  # a live list: vLLM appends output tokens to it
    plan, _ = planner(lay, store)
    assert plan.match("r", tokens, 10, 0) == 0
    steps = []

    def step(block_ids: list[int] | None, replace: bool, computed: int, scheduled: int) -> None:
        loads: list[BlockTransfer] = []
        saves: list[BlockTransfer] = []
        plan.scheduled("r", block_ids=block_ids, replace_blocks=replace, num_computed=computed,
                       num_scheduled=scheduled, loads=loads, saves=saves)  # fmt: skip
        steps.append(plan.step(loads, saves, []))

    step([3, 4, 5], True, 0, 10)  # prefill: blocks 0, 1 full
    tokens.append(50)
    step(None, False, 10, 1)  # decode token 10
    tokens.append(51)
    step(None, False, 11, 1)  # token 11: block 2 full
    tokens.append(52)
    step([6], False, 12, 1)
    assert [[(s.first_block, s.block_ids) for s in st.saves] for st in steps] == [
        [(0, (3, 4))],
        [],
        [(2, (5,))],
        [],
    ]
    chain = HashChain(lay)
    chain.extend(tokens, 3)
    assert steps[2].saves[0].hashes == ((chain.chains[0][2],),)


def test_a_block_whose_last_token_is_not_known_yet_waits() -> None:
    lay, store = layout(), Store()
    tokens = list(range(7))
    plan, _ = planner(lay, store)
    plan.match("r", tokens, 7, 0)
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    # 8 tokens computed, but only 7 known (a placeholder or draft at position 7)
    plan.scheduled("r", block_ids=[1, 2], replace_blocks=True, num_computed=0, num_scheduled=8,
                   loads=loads, saves=saves)  # fmt: skip
    assert [s.block_ids for s in saves] == [(1,)]


def test_blocks_the_store_already_had_are_not_saved_again() -> None:
    lay, store = layout(), Store()
    tokens = list(range(17))
    store.hold(lay, tokens, 2)
    plan, _ = planner(lay, store, load=False)  # a producer: saves only
    assert plan.match("r", tokens, 17, 0) == 0
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    plan.scheduled("r", block_ids=[1, 2, 3, 4, 5], replace_blocks=True, num_computed=0,
                   num_scheduled=17, loads=loads, saves=saves)  # fmt: skip
    assert [(s.first_block, s.block_ids) for s in saves] == [(2, (3, 4))]
    assert loads == []


def test_a_finished_request_with_saves_is_held_and_its_last_blocks_saved() -> None:
    lay, store = layout(), Store()
    tokens = list(range(6))
    plan, _ = planner(lay, store)
    plan.match("r", tokens, 6, 0)
    plan.match("quiet", list(range(2)), 2, 0)
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    plan.scheduled("r", block_ids=[1, 2], replace_blocks=True, num_computed=0, num_scheduled=6,
                   loads=loads, saves=saves)  # fmt: skip
    plan.step(loads, saves, [])
    tokens.extend([7, 8])
    assert plan.finished("r", [1, 2], 8) is True
    assert plan.finished("quiet", [], 0) is False  # no save: vLLM frees its blocks at once
    step = plan.step([], [], [])
    assert step.held == ("r",)
    assert [(s.first_block, s.block_ids) for s in step.saves] == [(1, (2,))]
    assert plan.tracked == 0


def test_a_preempted_request_drops_its_blocks_and_is_named_for_the_workers() -> None:
    lay, store = layout(), Store()
    tokens = list(range(9))
    plan, _ = planner(lay, store)
    plan.match("r", tokens, 9, 0)
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    plan.scheduled("r", block_ids=[1, 2, 3], replace_blocks=True, num_computed=0, num_scheduled=6,
                   loads=loads, saves=saves)  # fmt: skip
    plan.preempted("r")
    step = plan.step(loads, saves, ["r"])
    assert step.preempted == ("r",)
    # resumed later with new blocks: the saved block 0 is not saved again
    plan.match("r", tokens, 9, 0)
    loads, saves = [], []
    plan.scheduled("r", block_ids=[7, 8, 9], replace_blocks=True, num_computed=0, num_scheduled=9,
                   loads=loads, saves=saves)  # fmt: skip
    assert [(s.first_block, s.block_ids) for s in saves] == [(1, (8,))]


def test_long_prompts_are_matched_in_runs_that_stop_at_the_first_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvpool.integrations.vllm_plan as plan_module

    monkeypatch.setattr(plan_module, "MAX_MATCH_KEYS", 6)  # 3 blocks of 2 layers a call
    lay, store = layout(), Store()
    tokens = list(range(4 * 10 + 1))
    store.hold(lay, tokens, 7)
    plan, _ = planner(lay, store)
    assert plan.match("r", tokens, len(tokens), 0) == 7 * BS
    assert [len(c) for c in store.calls] == [6, 6, 6]
