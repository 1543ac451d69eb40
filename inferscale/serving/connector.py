"""InferScaleConnector: vLLM KV connector that injects stored per-fact KV into paged blocks.

Load with ``--kv-transfer-config '{"kv_connector": "InferScaleConnector",
"kv_connector_module_path": "inferscale.serving.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute"}'`` (``inferscale serve`` does).

vLLM builds one instance per process role; this class only builds the half of its role and
guards every hook: the scheduler half (``connector_scheduler.py``, EngineCore) claims the memory
span of a request whose signed plan checks out; the worker half (``connector_worker.py``, each
Worker) pages that KV in and writes it into the request's blocks. They share nothing but the
per-step metadata (ids and positions). EngineCore dies on any exception from a hook, so
``_never_raises`` answers "compute normally" instead.

It supports vLLM's hybrid KV cache manager (``SupportsHMA``), which keeps a sliding-window
layer's blocks only inside its window: the rows vLLM keeps no block for are not written, and
loads are asynchronous wherever a failure could not be recomputed by block (``asynchronous``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.settings import Settings, get_settings
from inferscale.kv.key_scales import resolve_key_scales
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.kv.rope import ChunkedRope, model_head_dim
from inferscale.kv.store import KVStore
from inferscale.serving.connector_scheduler import ConnectorScheduler, InferScaleMetadata
from inferscale.serving.connector_worker import ConnectorWorker, layer_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("inferscale.serving.connector")
Hook = TypeVar("Hook", bound=Callable[..., Any])


def _never_raises(fallback: Callable[..., Any]) -> Callable[[Hook], Hook]:
    """Hook guard: EngineCore dies on any exception from a connector hook, so an unexpected one
    is logged and counted, and ``fallback(self, *args)`` answers instead (compute normally)."""

    def wrap(hook: Hook) -> Hook:
        @functools.wraps(hook)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return hook(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - nothing may reach EngineCore
                log.exception("connector hook %s failed; falling back", hook.__name__)
                KV_METRICS.hook_errors.labels(hook.__name__).inc()
                return fallback(self, *args, **kwargs)

        return guarded  # type: ignore[return-value]

    return wrap


def asynchronous(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether loads must be asynchronous, failed per request: with several KV cache groups
    vLLM cannot map a failed block id back to a request (it raises), and a sliding-window group
    holds the null block before its window, over which vLLM would resume a recompute from the
    first failed block. Synchronous only for one group of full attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if kv_cache_config is None:
        return False
    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or not all(isinstance(group.kv_cache_spec, FullAttentionSpec)
                                      for group in groups)


def _worker_half(vllm_config: VllmConfig, settings: Settings, fingerprint: str,
                 kv_cache_config: KVCacheConfig | None) -> ConnectorWorker:
    """The worker half for the served model, its memory tiers on the device it runs on."""
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = KVStore.from_settings(settings, fingerprint, settings.host_cache_bytes,
                                  settings.device_cache_bytes, device=device)
    rope = ChunkedRope(hf, model_config.dtype, device,
                       max_position=max(model_config.max_model_len, 1))
    scales = resolve_key_scales(settings.key_scales, model_config.model, hf.num_hidden_layers)
    log.info("key scales: %s", scales.source if scales else "none")
    kv_shape = (hf.num_hidden_layers, model_config.get_total_num_kv_heads(), model_head_dim(hf))
    return ConnectorWorker(store, rope, model_config.dtype, kv_shape,
                           vllm_config.cache_config.block_size, scales,
                           layer_groups(kv_cache_config, hf.num_hidden_layers))


class InferScaleConnector(KVConnectorBase_V1, SupportsHMA):
    """Injects memory KV (preamble + facts) as an external prefix of the prompt."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = get_settings()
        if not settings.plan_secret:
            raise RuntimeError("INFERSCALE_PLAN_SECRET is not set: start with `inferscale serve`")
        fingerprint = model_fingerprint(vllm_config.model_config.model)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.WORKER:
            self._worker = _worker_half(vllm_config, settings, fingerprint, kv_cache_config)
        else:
            self._scheduler = ConnectorScheduler(
                settings.plan_secret, fingerprint,
                KVStore.from_settings(settings, fingerprint, host_bytes=0),
                asynchronous(kv_cache_config), vllm_config.cache_config.block_size)

    @property
    def scheduler(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler hook called on the worker side")
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("a worker hook called on the scheduler side")
        return self._worker

    # --- scheduler side -----------------------------------------------------------------------

    def _claim_nothing(self, request: Request, *_: Any) -> tuple[int, bool]:
        if self._scheduler is not None:
            self._scheduler.drop(request)
        return 0, False

    @_never_raises(_claim_nothing)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def _blocks_later(self, request: Request, *_: Any) -> None:
        """build_connector_meta takes the claim's blocks from the scheduler output instead."""

    @_never_raises(_blocks_later)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks, num_external_tokens)

    @_never_raises(lambda self, *_: InferScaleMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.step_metadata(scheduler_output)

    @_never_raises(lambda self, *_: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    @_never_raises(lambda self, *_: (False, None))
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    @_never_raises(lambda self, *_: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.transfers_failed(set(connector_output.failed_recving or ()))

    # --- worker side --------------------------------------------------------------------------

    def _fail_all_loads(self, *_: Any, **__: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None:
            self._worker.fail(getattr(meta, "loads", []))

    @_never_raises(_fail_all_loads)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleMetadata) or not meta.loads:
            return
        with KV_METRICS.inject_seconds.time():
            self.worker.load(meta.loads, forward_context)

    @_never_raises(lambda self: set())
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    def _nothing_received(self, *_: Any) -> KVConnectorTransferResults:
        return KVConnectorTransferResults()

    @_never_raises(_nothing_received)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        received, failed = self.worker.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def purge(self, locations: list[str]) -> int:
        """Drop blobs from this worker's memory tiers (a forget or an update elsewhere)."""
        return self.worker.purge(locations)

    def memory_tiers(self, locations: list[str]) -> list[list[str]]:
        """For each blob, this worker's memory tiers that hold it (the memory API's KV
        status)."""
        return self.worker.memory_tiers(locations)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return


class InferScaleWorkerExtension:
    """Methods vLLM grafts onto its workers (``--worker-extension-cls``), called from the API
    server with ``engine_client.collective_rpc(name, args=...)``."""

    def inferscale_purge(self, locations: list[str]) -> int:
        """Purge these blobs from the connector's host/device tiers in this worker."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().purge(list(locations))

    def inferscale_tiers(self, locations: list[str]) -> list[list[str]]:
        """For each blob, the connector's memory tiers that hold it in this worker."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().memory_tiers(list(locations))
