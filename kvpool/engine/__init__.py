"""An example inference engine on kvpool (``kvpool demo chat``); needs the ``llm`` extra.

* :mod:`~kvpool.engine.model` — a small Llama-style model from a config, seeded random weights
  (no downloads), and a byte tokenizer
* :mod:`~kvpool.engine.kvcache` — transformers' KV cache to and from one tensor per token run
* :mod:`~kvpool.engine.connector` — :class:`KVConnector`: load a prompt's cached blocks
  (``prefix_match`` + one batched get, cost model first), save the new ones
* :mod:`~kvpool.engine.engine` — :class:`Engine`: prefill on the loaded KV, greedy decode, TTFT
* :mod:`~kvpool.engine.chat` — the demo: shared system prompts and multi-turn chats, with and
  without kvpool, the store killed mid-run, the cost model on a slow tier; a report
* :mod:`~kvpool.engine.vllm_runner` — a real vLLM engine in a process of its own, driven by JSON
  lines (``kvpool demo vllm`` and the vLLM engine tests); needs vLLM in that process only
* :mod:`~kvpool.engine.vllm_demo` — ``kvpool demo vllm``: TTFT with and without kvpool's KV
  connector (``kvpool.integrations.vllm``) in real vLLM engines

Importing this package needs neither torch nor transformers; building a model does
(:func:`~kvpool.engine.model.require_llm` says how to install them).
"""
