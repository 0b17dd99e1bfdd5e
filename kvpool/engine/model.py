"""A small Llama-style model built from a config with seeded random weights — no downloads.

The weights are random, so the text it writes is noise; what the example engine shows is that
its outputs with KV blocks loaded from kvpool are the outputs without them. The architecture is
the real one (``transformers``' ``LlamaForCausalLM``: RoPE, grouped-query attention, SwiGLU,
RMSNorm), so its KV cache has the shapes and the cost profile of a real model's.

Tokens are bytes (ids 0-255) plus a few special ids: no tokenizer files either.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.errors import ConfigError

LLM_INSTALL_HINT = "pip install 'kvpool[llm]'  (torch CPU + transformers)"

BOS, END_OF_TURN, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259, 260
VOCAB_SIZE = 320


class LlmUnavailableError(ConfigError):
    """torch or transformers is not installed."""

    code = "LLM_UNAVAILABLE"


def require_llm() -> None:
    """Raise LlmUnavailableError, saying how to install them, unless torch and transformers
    import."""
    missing = []
    for name in ("torch", "transformers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise LlmUnavailableError(
            f"the example engine needs {' and '.join(missing)}: {LLM_INSTALL_HINT}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """The model's shape and seed; equal specs build equal weights (same torch version)."""

    hidden_size: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate_size: int = 1408
    vocab_size: int = VOCAB_SIZE
    max_positions: int = 16384
    seed: int = 0
    init_std: float = 0.1
    """Weights ~ N(0, init_std): 0.1 makes the next token depend strongly on the context (with
    HF's 0.02 a random model says nearly the same thing whatever it is told)."""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        errors = []
        for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be at least 1")
        if self.hidden_size % self.heads:
            errors.append("hidden_size: must be a multiple of heads")
        if self.heads % self.kv_heads:
            errors.append("heads: must be a multiple of kv_heads")
        if self.vocab_size < VOCAB_SIZE:
            errors.append(f"vocab_size: must be at least {VOCAB_SIZE}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            errors.append("dtype: float32, bfloat16 or float16")
        if errors:
            raise ConfigError("invalid model spec:\n  " + "\n  ".join(errors))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def kv_layout(self) -> str:
        """How one KV block is laid out: (layers, K/V, kv heads, tokens, head dim)."""
        return f"hf-llama:L{self.layers},2,H{self.kv_heads},T,D{self.head_dim}"

    @property
    def name(self) -> str:
        """A model name that changes with any field (the key namespace's model)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return f"kvpool-tiny-llama-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            initializer_range=self.init_std,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=BOS,
            eos_token_id=END_OF_TURN,
            pad_token_id=None,
        )
        config._attn_implementation = "sdpa"
        return config

    def build(self) -> Any:
        """The model, in eval mode, weights drawn from ``seed`` (the global RNG is untouched)."""
        require_llm()
        import torch
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = LlamaForCausalLM(self.hf_config())
        return model.to(getattr(torch, self.dtype)).eval()


TEST_SPEC = ModelSpec(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128)
"""A model small enough for tests: a prefill of 512 tokens takes milliseconds."""


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus chat markers. No files, no downloads."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, system: str, turns: list[tuple[str, str]]) -> list[int]:
        """A conversation as ids: BOS, the system prompt, then (role, text) turns, each ended by
        END_OF_TURN, and the assistant's marker to answer after."""
        ids = [BOS, SYSTEM, *self.encode(system), END_OF_TURN]
        for role, text in turns:
            ids += [USER if role == "user" else ASSISTANT, *self.encode(text), END_OF_TURN]
        return [*ids, ASSISTANT]
