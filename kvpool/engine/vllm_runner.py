"""A real vLLM engine in a process of its own, driven by JSON lines: ``kvpool demo vllm`` and the
vLLM engine tests start one per engine (with kvpool, without it, a second "decode" instance).

    python -m kvpool.engine.vllm_runner '{"model_dir": DIR, "kvpool": {...} | null, ...}'
    stdin:  {"op": "generate", "prompts": [[token ids], ...], "max_tokens": 8}
    stdout: {"ok": true, "outputs": [{"tokens": [...], "cached_tokens": n, "ttft_s": t}, ...]}

The model is a small Llama built from a ``config.json`` (:func:`write_model_config`) with
vLLM's dummy weights (deterministic, no download) and token-id prompts (no tokenizer): what it
computes is real vLLM work on this CPU, whatever the weights. Greedy decoding.

Answers are the lines of stdout; anything else the process prints goes to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyLlama:
    """A Llama shape for vLLM's CPU backend (head size 64: one the backend supports)."""

    hidden_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 704
    vocab_size: int = 512
    max_position_embeddings: int = 8192


def write_model_config(directory: str | Path, spec: TinyLlama) -> Path:
    """A Hugging Face ``config.json`` for ``spec`` (bfloat16) in ``directory``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def spec_json(spec: TinyLlama) -> dict[str, Any]:
    return asdict(spec)


class EngineError(RuntimeError):
    """The engine process failed, answered an error, or did not answer in time."""


class EngineProcess:
    """A :func:`main` process (its own process group: vLLM's engine-core child goes with it)."""

    def __init__(self, options: dict[str, Any], *, python: str = sys.executable, log: Path) -> None:
        self.options = options
        self.python = python
        self.log_path = log
        self.proc: subprocess.Popen[str] | None = None
        self.startup_s = 0.0

    def start(self, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [self.python, "-m", "kvpool.engine.vllm_runner", json.dumps(self.options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        ready = self._read(timeout_s)
        self.startup_s = float(ready.get("startup_s", 0.0))
        return self

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"the engine did not answer within {timeout_s:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise EngineError(
                    f"the engine exited (code {self.proc.poll()}); see {self.log_path}"
                )
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                if not answer.get("ok"):
                    raise EngineError(str(answer.get("error")))
                return answer

    def generate(
        self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300.0
    ) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdin is not None
        command = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.close()
            proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            # The group is the runner's own session: vLLM's engine core and workers in it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_ANSWERS: Any = None


def _answer(obj: dict[str, Any]) -> None:
    _ANSWERS.write(json.dumps(obj) + "\n")
    _ANSWERS.flush()


def _engine(options: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.get("kv_cache_gib", 1)))
    # OpenMP threads that spin after each parallel region (the default) starve everything else
    # on a small machine, idle engines included: every engine here waits passively.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": options["model_dir"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": options.get("dtype", "bfloat16"),
        "max_model_len": int(options.get("max_model_len", 4096)),
        "seed": 0,
        "enable_prefix_caching": bool(options.get("prefix_caching", True)),
        "disable_log_stats": False,
    }
    if options.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(options["max_num_batched_tokens"])
    if options.get("kvpool") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": options.get("kv_role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": options["kvpool"],
        }
    return LLM(**kwargs)


def _generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(command.get("max_tokens", 8)))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in command["prompts"]]
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    outputs = []
    for result in results:
        metrics = getattr(result, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        outputs.append(
            {
                "tokens": list(result.outputs[0].token_ids),
                "cached_tokens": int(result.num_cached_tokens or 0),
                "ttft_s": float(ttft) if ttft else None,
            }
        )
    return {"ok": True, "outputs": outputs, "wall_s": wall}


def main(argv: list[str]) -> int:
    global _ANSWERS
    options = json.loads(argv[1])
    # Answers keep the real stdout; everything else printed (vLLM logs to stdout) goes to stderr.
    _ANSWERS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    started = time.perf_counter()
    llm = _engine(options)
    _answer({"ok": True, "ready": True, "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            _answer(_generate(llm, command))
        except Exception as e:
            _answer({"ok": False, "error": f"{type(e).__name__}: {e}"})
    _answer({"ok": True, "bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
