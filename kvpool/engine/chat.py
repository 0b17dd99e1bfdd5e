"""``kvpool demo chat``: what kvpool does for time-to-first-token, measured on a real model.

A local cluster (3 masters, 2 nodes with a CPU and an SSD tier), one model, two engines over it:
one loads and saves KV blocks through kvpool, the other recomputes everything. Every request is
run by both, in alternating order, and their greedy tokens and logits are compared.

1. **Shared system prompt**: a long system prompt and different questions after it.
2. **Multi-turn chats**: each turn's prompt is the whole conversation so far.
3. **A slow tier**: a prefix pushed out to the SSD tier by a flood of other blocks, read back
   with the cost model as measured (SSD reads beat recompute: read) and with the SSD declared
   slow (skip those blocks, recompute them): the report shows what it skipped.
4. **The store killed mid-run**: store nodes killed (SIGKILL) between requests, then the
   masters; requests fall back to recomputing, with the same outputs.

Everything it starts is stopped at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvpool.client.cost import DEFAULT_TIER_SPEEDS, CostModel, TierSpeed
from kvpool.client.sync import Client
from kvpool.engine.engine import Engine, Generation
from kvpool.engine.model import ASSISTANT, BOS, END_OF_TURN, SYSTEM, USER, ModelSpec
from kvpool.launcher.cluster import LocalCluster
from kvpool.units import format_size

Say = Callable[[str], None]


@dataclass(frozen=True)
class ChatSettings:
    spec: ModelSpec = field(default_factory=ModelSpec)
    block_size: int = 64
    system_tokens: int = 2048
    question_tokens: int = 40
    requests: int = 6
    conversations: int = 2
    turns: int = 4
    conversation_system_tokens: int = 512
    turn_tokens: int = 96
    new_tokens: int = 8
    tier_prefix_tokens: int = 1024
    seed: int = 7
    timeout_s: float = 2.0
    cpu_cache_size: str = "64MiB"
    ssd_cache_size: str = "512MiB"
    ssd_segment_size: str = "16MiB"
    flood_bytes: int = 384 << 20
    slow_ssd_bytes_per_s: float = 2e6
    """The SSD as a slow network disk, for the cost-model run that skips it."""


QUICK = ChatSettings(
    spec=ModelSpec(hidden_size=256, layers=4, heads=4, kv_heads=2, intermediate_size=704),
    block_size=32,
    system_tokens=512,
    question_tokens=16,
    requests=3,
    conversations=1,
    turns=2,
    conversation_system_tokens=128,
    turn_tokens=32,
    new_tokens=4,
    tier_prefix_tokens=256,
    cpu_cache_size="16MiB",
    ssd_cache_size="128MiB",
    ssd_segment_size="8MiB",
    flood_bytes=64 << 20,
    timeout_s=1.0,
)
"""A small model and short prompts: the whole demo in seconds (tests, smoke runs). Its numbers
are not the point: a model this small recomputes a prompt in milliseconds."""


@dataclass
class Request:
    section: str
    label: str
    prompt_tokens: int
    cached: Generation
    plain: Generation | None
    note: str = ""

    @property
    def same_tokens(self) -> bool:
        return self.plain is not None and self.cached.tokens == self.plain.tokens

    @property
    def max_logit_diff(self) -> float:
        if self.plain is None:
            return float("nan")
        return max(
            float((a - b).abs().max())
            for a, b in zip(self.cached.logits, self.plain.logits, strict=False)
        )

    def to_json(self) -> dict[str, Any]:
        load = self.cached.load
        return {
            "section": self.section,
            "label": self.label,
            "prompt_tokens": self.prompt_tokens,
            "ttft_cached_s": self.cached.ttft_s,
            "ttft_plain_s": self.plain.ttft_s if self.plain else None,
            "load_s": load.seconds if load else 0.0,
            "prefill_cached_s": self.cached.prefill_s,
            "prefill_tokens": self.cached.prefill_tokens,
            "prompt_blocks": load.prompt_blocks if load else 0,
            "matched_blocks": load.matched_blocks if load else 0,
            "loaded_blocks": load.loaded_blocks if load else 0,
            "loaded_tokens": load.tokens if load else 0,
            "skipped_slow_tier": load.skipped_slow_tier if load else 0,
            "bytes_loaded": load.bytes if load else 0,
            "bytes_saved": self.cached.save.bytes if self.cached.save else 0,
            "plan": load.plan.describe() if load and load.plan else "",
            "failure": load.failure if load else "",
            "same_tokens": self.same_tokens,
            "max_logit_diff": self.max_logit_diff,
            "note": self.note,
        }


class ChatDemo:
    """Runs the sections on a started cluster; see the module doc."""

    def __init__(self, settings: ChatSettings, cluster: LocalCluster, say: Say) -> None:
        self.s = settings
        self.cluster = cluster
        self.say = say
        self.rng = random.Random(settings.seed)
        self.requests: list[Request] = []
        self.model = settings.spec.build()
        # strict: a dead store raises (the connector then leaves it alone for a while) rather
        # than answering "nothing cached" after each call's whole deadline.
        self.kv = Client(cluster.client_master_addresses, timeout_s=settings.timeout_s, strict=True)
        self.cost = CostModel()
        self.cached = self._engine(self.cost)
        self.plain = Engine.create(settings.spec, model=self.model)

    def close(self) -> None:
        self.kv.close()

    def _engine(self, cost: CostModel) -> Engine:
        return Engine.create(
            self.s.spec, client=self.kv, block_size=self.s.block_size, cost_model=cost,
            model=self.model,
        )  # fmt: skip

    def _text(self, n: int) -> list[int]:
        return [self.rng.randrange(256) for _ in range(n)]

    def _run(self, section: str, label: str, prompt: list[int], engine: Engine | None = None,
             note: str = "") -> Request:  # fmt: skip
        engine = engine or self.cached
        n = self.s.new_tokens
        if len(self.requests) % 2:  # alternate which engine goes first
            plain = self.plain.generate(prompt, n)
            cached = engine.generate(prompt, n)
        else:
            cached = engine.generate(prompt, n)
            plain = self.plain.generate(prompt, n)
        request = Request(section, label, len(prompt), cached, plain, note)
        self.requests.append(request)
        self.say(_row(request))
        return request

    # --- sections --------------------------------------------------------------------------

    def shared_prompt(self) -> None:
        s = self.s
        self.say(
            f"\n1. Shared system prompt: {s.system_tokens} tokens, then {s.requests} different "
            f"questions of {s.question_tokens} tokens"
        )
        self.say(HEADER)
        self.system = self._text(s.system_tokens)
        for i in range(s.requests):
            prompt = [BOS, SYSTEM, *self.system, END_OF_TURN, USER,
                      *self._text(s.question_tokens), END_OF_TURN, ASSISTANT]  # fmt: skip
            self._run("shared", f"question {i + 1}", prompt)

    def multi_turn(self) -> None:
        s = self.s
        self.say(
            f"\n2. Multi-turn chats: {s.conversations} conversations of {s.turns} turns "
            f"({s.conversation_system_tokens}-token system prompt, {s.turn_tokens}-token messages)"
        )
        self.say(HEADER)
        for c in range(s.conversations):
            history = [BOS, SYSTEM, *self._text(s.conversation_system_tokens), END_OF_TURN]
            for t in range(s.turns):
                history += [USER, *self._text(s.turn_tokens), END_OF_TURN, ASSISTANT]
                request = self._run("multi_turn", f"chat {c + 1} turn {t + 1}", history)
                history = [*history, *request.cached.tokens, END_OF_TURN]

    def slow_tier(self) -> None:
        s = self.s
        self.say(
            f"\n3. A slow tier: a {s.tier_prefix_tokens}-token prefix written once, then "
            f"{format_size(s.flood_bytes)} of other blocks push it from CPU memory to the SSD tier"
        )
        prefix = [BOS, SYSTEM, *self._text(s.tier_prefix_tokens), END_OF_TURN, USER]
        first = self.cached.generate([*prefix, *self._text(8), END_OF_TURN, ASSISTANT], 1)
        written = first.save.stored if first.save else 0
        flooded = self._flood(s.flood_bytes)
        self.say(f"   prefix: {written} blocks written; flood: {flooded} blocks put")
        time.sleep(1.0)  # tier moves reach the index in batches (every 0.2 s)
        slow = dict(DEFAULT_TIER_SPEEDS)
        slow["ssd"] = TierSpeed(s.slow_ssd_bytes_per_s, slow["ssd"].per_block_s)
        slow_cost = CostModel(slow, recompute_s_per_token=self.cost.recompute_s_per_token)
        self.say(HEADER)
        question = [*prefix, *self._text(s.question_tokens), END_OF_TURN, ASSISTANT]
        self._run("slow_tier", "SSD declared slow", question, self._engine(slow_cost),
                  note=f"SSD at {format_size(int(s.slow_ssd_bytes_per_s))}/s")  # fmt: skip
        question = [*prefix, *self._text(s.question_tokens), END_OF_TURN, ASSISTANT]
        self._run("slow_tier", "SSD as measured", question)

    def _flood(self, nbytes: int) -> int:
        block = bytearray(random.Random(self.s.seed).randbytes(1 << 20))
        put = 0
        for start in range(0, nbytes >> 20, 8):
            items = []
            for i in range(start, min(start + 8, nbytes >> 20)):
                block[:8] = i.to_bytes(8, "little")
                items.append((f"demo-chat/filler/{i}", bytes(block)))
            put += sum(self.kv.batch_put(items))
        return put

    def store_killed(self) -> None:
        s = self.s
        self.say("\n4. The store killed mid-run (same shared system prompt as in 1)")
        self.say(HEADER)

        def ask() -> list[int]:
            return [BOS, SYSTEM, *self.system, END_OF_TURN, USER,
                    *self._text(s.question_tokens), END_OF_TURN, ASSISTANT]  # fmt: skip

        self._run("killed", "before the kill", ask())
        for name in self.cluster.node_names:
            self.cluster.kill(name)
        self._run("killed", "nodes killed", ask(), note="every store node SIGKILLed")
        self._run("killed", "nodes killed", ask(), note="every store node SIGKILLed")
        for name in self.cluster.master_names:
            self.cluster.kill(name)
        self._run("killed", "masters killed", ask(), note="every master SIGKILLed too")
        self._run("killed", "masters killed", ask(), note="the connector leaves the store alone")


HEADER = (
    "   request              prompt  loaded blocks    TTFT kvpool  TTFT recompute  speed-up  "
    "same tokens  max|Δlogit|"
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms"


def _row(r: Request) -> str:
    load = r.cached.load
    loaded = f"{load.loaded_blocks}/{load.prompt_blocks}" if load else "-"
    plain = r.plain.ttft_s if r.plain else float("nan")
    speedup = plain / r.cached.ttft_s if r.cached.ttft_s > 0 else float("nan")
    line = (
        f"   {r.label:<20} {r.prompt_tokens:6d}  {loaded:>13}  {_ms(r.cached.ttft_s)}  "
        f"{_ms(plain)}     {speedup:5.1f}x  {'yes' if r.same_tokens else 'NO':>11}  "
        f"{r.max_logit_diff:11.2e}"
    )
    notes = []
    if r.section == "slow_tier" and load is not None and load.plan is not None:
        notes.append(f"cost model: {load.plan.describe()}")
    if load is not None and load.skipped_slow_tier:
        notes.append(f"skipped {load.skipped_slow_tier} blocks held only on a slower tier")
    if load is not None and load.failure:
        reason = load.failure if len(load.failure) <= 110 else load.failure[:107] + "..."
        notes.append(f"fell back to recompute: {reason}")
    if r.note:
        notes.append(r.note)
    return line + "".join(f"\n      {n}" for n in notes)


def summarize(requests: list[Request]) -> dict[str, Any]:
    """The numbers the report ends with (also the JSON's ``summary``)."""
    shared = [r for r in requests if r.section == "shared"][1:]  # the first one fills the cache
    cached_ttft = [r.cached.ttft_s for r in shared]
    plain_ttft = [r.plain.ttft_s for r in shared if r.plain]
    served = [r for r in requests if r.section in ("shared", "multi_turn") and r.cached.load]
    prompt_blocks = sum(r.cached.load.prompt_blocks for r in served if r.cached.load)
    loaded_blocks = sum(r.cached.load.loaded_blocks for r in served if r.cached.load)
    prompt_tokens = sum(r.prompt_tokens for r in served)
    loaded_tokens = sum(r.cached.load.tokens for r in served if r.cached.load)
    compared = [r for r in requests if r.plain is not None]
    same = [r for r in compared if r.same_tokens]
    return {
        "shared_prefix_ttft_cached_s": statistics.median(cached_ttft) if cached_ttft else None,
        "shared_prefix_ttft_recompute_s": statistics.median(plain_ttft) if plain_ttft else None,
        "shared_prefix_speedup": (
            statistics.median(plain_ttft) / statistics.median(cached_ttft)
            if cached_ttft and plain_ttft
            else None
        ),
        "block_hit_rate": loaded_blocks / prompt_blocks if prompt_blocks else 0.0,
        "token_hit_rate": loaded_tokens / prompt_tokens if prompt_tokens else 0.0,
        "bytes_loaded": sum(r.cached.load.bytes for r in requests if r.cached.load),
        "bytes_saved": sum(r.cached.save.bytes for r in requests if r.cached.save),
        "identical_outputs": len(same),
        "compared_outputs": len(compared),
        "max_logit_diff": max((r.max_logit_diff for r in same), default=0.0),
        "skipped_slow_tier_blocks": sum(
            r.cached.load.skipped_slow_tier for r in requests if r.cached.load
        ),
        "fallbacks": sum(1 for r in requests if r.cached.load and r.cached.load.failure),
    }


def render_summary(summary: dict[str, Any], settings: ChatSettings) -> list[str]:
    lines = ["\nSummary"]
    if summary["shared_prefix_speedup"] is not None:
        lines.append(
            f"   TTFT on the cached {settings.system_tokens}-token prefix (median of "
            f"{settings.requests - 1} requests): {_ms(summary['shared_prefix_ttft_cached_s'])} "
            f"with kvpool vs {_ms(summary['shared_prefix_ttft_recompute_s'])} recomputing: "
            f"{summary['shared_prefix_speedup']:.1f}x lower"
        )
    lines += [
        f"   hit rate (sections 1-2): {summary['block_hit_rate']:.1%} of prompt blocks, "
        f"{summary['token_hit_rate']:.1%} of prompt tokens",
        f"   bytes moved: {format_size(summary['bytes_loaded'])} loaded, "
        f"{format_size(summary['bytes_saved'])} saved",
        f"   identical greedy outputs with and without kvpool: {summary['identical_outputs']}"
        f"/{summary['compared_outputs']} requests (max |Δlogit| {summary['max_logit_diff']:.2e})",
        f"   cost model: {summary['skipped_slow_tier_blocks']} blocks skipped on a tier slower "
        f"than recomputing them; {summary['fallbacks']} requests fell back to recompute",
    ]
    return lines


def run_chat(
    settings: ChatSettings | None = None,
    *,
    directory: str | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """Start a cluster, run the four sections, stop everything; the report as a dict."""
    from kvpool.engine.model import require_llm

    require_llm()
    settings = settings or ChatSettings()
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-chat-"))
    spec = settings.spec
    say(
        f"kvpool demo chat: model {spec.name}: {spec.layers} layers, hidden {spec.hidden_size}, "
        f"{spec.heads} heads ({spec.kv_heads} KV), {spec.dtype}, seeded random weights; "
        f"KV {format_size(spec.kv_bytes_per_token)}/token, blocks of {settings.block_size} tokens"
        f" ({format_size(spec.kv_bytes_per_token * settings.block_size)})"
    )
    cluster = LocalCluster(
        root,
        masters=3,
        nodes=2,
        cpu_cache_size=settings.cpu_cache_size,
        in_memory=True,
        extra_node_flags=[
            "--ssd-cache-path", "{dir}/{name}-ssd",
            "--ssd-cache-size", settings.ssd_cache_size,
            "--ssd-segment-size", settings.ssd_segment_size,
            "--max-block-size", "4MiB",
        ],
    )  # fmt: skip
    demo: ChatDemo | None = None
    try:
        cluster.start()
        say(
            f"cluster: 3 masters + 2 store nodes (CPU {settings.cpu_cache_size} + SSD "
            f"{settings.ssd_cache_size} each) on 127.0.0.1, in {root}"
        )
        demo = ChatDemo(settings, cluster, say)
        demo.shared_prompt()
        demo.multi_turn()
        demo.slow_tier()
        demo.store_killed()
        summary = summarize(demo.requests)
        for line in render_summary(summary, settings):
            say(line)
        return {
            "settings": {
                f.name: getattr(settings, f.name) for f in fields(settings) if f.name != "spec"
            },
            "model": {"name": spec.name, **vars(spec)},
            "requests": [r.to_json() for r in demo.requests],
            "summary": summary,
        }
    finally:
        if demo is not None:
            demo.close()
        cluster.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
