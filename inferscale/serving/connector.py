"""InferScaleConnector: vLLM KV connector that injects stored per-fact KV into paged blocks.

Load with ``--kv-transfer-config '{"kv_connector": "InferScaleConnector",
"kv_connector_module_path": "inferscale.serving.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute"}'``.

Scheduler side (EngineCore): authenticates the request's signed plan, checks the prompt tokens
of every segment, and claims the memory span (preamble + injected facts) minus the local
prefix-cache hit, never the last prompt token. Worker side: pages the segments' KV in by id
(device -> host -> durable), applies Chunked RoPE to all layers in one call (and the key scales
to the facts' keys, where the plan asks: ``key_scales.py``) and writes K/V with the attention
backend's own cache-update op (``kvchain.py``), or in one fused pass on the CPU
(``kvwrite.py``). A blob that is missing, corrupt, made for another model or does not match the
prompt is reported as failed blocks, which vLLM recomputes.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from cachetools import TTLCache
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.contracts.plan import PLAN_KEY, PREAMBLE, PlanError, Segment, verify
from inferscale.kv.chain import ChainWriter
from inferscale.kv.fused import FusedCpuWriter, FusedTritonWriter, first_exact, fused_writers
from inferscale.kv.key_scales import key_factor, resolve_key_scales
from inferscale.kv.rope import ChunkedRope, model_head_dim
from inferscale.kv.store import KVStore
from inferscale.platform.settings import get_settings
from inferscale.serving.metrics import KV_METRICS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("inferscale.serving.connector")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
# How long the scheduler trusts that a blob it saw is still there. A blob never changes under
# its name, and one deleted since only costs a recompute of its blocks (the load fails), so the
# plan check does not ask the durable tier (one HEAD request per fact on S3) at every step.
PRESENT_TTL_S = 60.0
PRESENT_MAX = 100_000
_UNDECIDED = object()


def _never_raises(fallback: Callable[..., Any]):
    """Hook guard: EngineCore dies on any exception from a connector hook, so an unexpected one
    is logged and counted, and ``fallback(self, *args)`` answers instead (compute normally)."""

    def wrap(hook):
        @functools.wraps(hook)
        def guarded(self, *args, **kwargs):
            try:
                return hook(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - nothing may reach EngineCore
                log.exception("connector hook %s failed; falling back", hook.__name__)
                KV_METRICS.hook_errors.labels(hook.__name__).inc()
                return fallback(self, *args, **kwargs)

        return guarded

    return wrap


@dataclass
class LoadSpec:
    """Positions ``[start, end)`` of one request to fill from ``segments`` into ``block_ids``;
    ``key_scales``: the strength the facts' keys are scaled with (the plan's; 0: unscaled)."""

    request_id: str
    start: int
    end: int
    segments: list[Segment]
    block_ids: list[int] = field(default_factory=list)
    key_scales: float = 0.0


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    """Per-step metadata: ids and positions only, never KV."""

    loads: list[LoadSpec] = field(default_factory=list)


class InferScaleConnector(KVConnectorBase_V1):
    """Injects memory KV (preamble + facts) as an external prefix of the prompt."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = get_settings()
        if not settings.plan_secret:
            raise RuntimeError("INFERSCALE_PLAN_SECRET is not set: start with `inferscale serve`")
        self._secret = settings.plan_secret
        self._block_size = vllm_config.cache_config.block_size
        model_config = vllm_config.model_config
        self._fingerprint = model_fingerprint(model_config.model)
        self._pending: dict[str, LoadSpec] = {}
        self._claimed: dict[str, int] = {}
        self._failed_blocks: set[int] = set()
        self._layers: list[tuple[int, Any]] | None = None
        self._writer: Any = _UNDECIDED  # a fused writer or None, once the layers are known
        if role == KVConnectorRole.WORKER:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self._store = KVStore.from_settings(settings, self._fingerprint,
                                                settings.host_cache_bytes,
                                                settings.device_cache_bytes, device=device)
            self._rope = ChunkedRope(model_config.hf_config, model_config.dtype, device,
                                     max_position=max(model_config.max_model_len, 1))
            self._chain = ChainWriter(self._rope)
            self._dtype = model_config.dtype
            hf = model_config.hf_config
            self._kv_shape = (hf.num_hidden_layers, model_config.get_total_num_kv_heads(),
                              model_head_dim(hf))
            scales = resolve_key_scales(settings.key_scales, model_config.model,
                                        hf.num_hidden_layers)
            self._key_scales = scales
            log.info("key scales: %s", scales.source if scales else "none")
        else:
            self._store = KVStore.from_settings(settings, self._fingerprint, host_bytes=0)
            self._present: TTLCache[str, bool] = TTLCache(PRESENT_MAX, PRESENT_TTL_S)

    # --- scheduler side -----------------------------------------------------------------------

    def _plan_for(self, request: Request):
        params = request.kv_transfer_params
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return None
        try:
            plan = verify(params[PLAN_KEY], self._secret)
        except PlanError as exc:
            log.warning("request %s: plan refused: %s", request.request_id, exc)
            return None
        if plan.fingerprint != self._fingerprint:
            log.warning("request %s: plan for another model", request.request_id)
            return None
        return plan

    def _claim_nothing(self, request: Request, *_: Any) -> tuple[int, bool]:
        self._pending.pop(request.request_id, None)
        return 0, False

    @_never_raises(_claim_nothing)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        with KV_METRICS.stage_seconds.labels("plan_check").time():
            return self._match(request, num_computed_tokens)

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        plan = self._plan_for(request)
        if plan is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        limit = len(prompt) - 1  # the last prompt token is always computed
        segments: list[Segment] = []
        for segment in plan.segments:
            if segment.end > limit or not segment.matches(prompt[segment.start:segment.end]):
                break
            if not self._blob_present(segment.name):
                break
            segments.append(segment)
        end = segments[-1].end if segments else 0
        if end <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = LoadSpec(request.request_id, num_computed_tokens,
                                                     end, segments, key_scales=plan.key_scales)
        return end - num_computed_tokens, False

    def _blob_present(self, name: str) -> bool:
        """Whether the durable blob ``name`` exists; positives are remembered (see above)."""
        if name not in self._present and self._store.exists(name):
            self._present[name] = True
        return name in self._present

    def _blocks_later(self, request: Request, *_: Any) -> None:
        """build_connector_meta takes the claim's blocks from the scheduler output instead."""

    @_never_raises(_blocks_later)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        spec = self._pending.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens <= 0:
            del self._pending[request.request_id]
            return
        spec.block_ids = list(blocks.get_block_ids()[0])
        self._claimed[request.request_id] = num_external_tokens

    @_never_raises(lambda self, *_: InferScaleMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = InferScaleMetadata()
        scheduled = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        resumed = {req_id: cached.new_block_ids[i] for i, req_id in enumerate(cached.req_ids)
                   if req_id in cached.resumed_req_ids}
        for req_id in list(self._pending):
            spec = self._pending[req_id]
            if req_id in scheduled:
                spec.block_ids = list(scheduled[req_id].block_ids[0])
            elif req_id in resumed and resumed[req_id] is not None:
                spec.block_ids = list(resumed[req_id][0])
            else:
                continue
            meta.loads.append(spec)
            del self._pending[req_id]
        return meta

    @_never_raises(lambda self, *_: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        injected = self._claimed.pop(request.request_id, 0)
        params = request.kv_transfer_params
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return False, None
        return False, {"injected_tokens": injected}

    # --- worker side --------------------------------------------------------------------------

    def _fail_all_loads(self, *_: Any, **__: Any) -> None:
        meta = self._get_connector_metadata()
        for spec in getattr(meta, "loads", []):
            self._failed_blocks |= self._blocks_of(spec)

    @_never_raises(_fail_all_loads)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleMetadata) or not meta.loads:
            return
        with KV_METRICS.inject_seconds.time():
            self._load(meta.loads, forward_context)

    def _load(self, loads: list[LoadSpec], forward_context: ForwardContext) -> None:
        """Page in every load's KV and write it, keys rotated to their positions (and the
        facts' keys scaled where the plan asks): with the fused CPU writer where it applies,
        else with the portable chain (``kvchain.py``). Positions, slots and scales are built on
        the host; the chain moves them to the device without waiting for it."""
        started = time.perf_counter()
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        positions, slots = [], []
        runs: list[tuple[torch.Tensor | None, int]] = []  # per piece: its key scales, tokens
        for spec in loads:
            try:
                spec_pieces = self._pieces(spec)
                spec_positions = torch.arange(spec.start, spec.end)
                spec_slots = self._slots(spec, spec_positions)
            except Exception as exc:  # noqa: BLE001 - any bad blob or spec: recompute it
                log.warning("request %s: falling back to prefill: %s", spec.request_id, exc)
                KV_METRICS.load_failures.labels(getattr(exc, "reason", "mismatch")).inc()
                self._failed_blocks |= self._blocks_of(spec)
                continue
            pieces += [(k, v) for k, v, _ in spec_pieces]
            positions.append(spec_positions)
            slots.append(spec_slots)
            runs += self._scale_runs(spec, spec_pieces)
        if not pieces:
            return
        layers = self._attention_layers(forward_context)
        scaled = any(run_scales is not None for run_scales, _ in runs)
        scales = key_factor(runs, self._kv_shape[0], dtype=pieces[0][0].dtype) if scaled else None
        slot_mapping, all_positions = torch.cat(slots), torch.cat(positions)
        writer = self._fused_writer(layers)
        paged_in = time.perf_counter()
        if writer is None:
            stages = self._chain.write(pieces, all_positions, slot_mapping, scales,
                                       self._cache_update(layers))
            stages["gather"] += paged_in - started
        else:
            writer.write(pieces, all_positions, slot_mapping, scales,
                         [layer.kv_cache for _, layer in sorted(layers, key=lambda p: p[0])])
            stages = {"gather": paged_in - started, "fused_write": time.perf_counter() - paged_in}
        for stage, seconds in stages.items():
            KV_METRICS.stage_seconds.labels(stage).observe(seconds)
        KV_METRICS.injected_tokens.inc(len(slot_mapping))

    @staticmethod
    def _cache_update(layers: list[tuple[int, Any]], caches: list[torch.Tensor] | None = None
                      ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """Layer i's K/V written with its attention backend's cache update, into ``caches[i]``
        (else the layer's own cache)."""
        by_index = dict(layers)

        def update(index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
            layer = by_index[index]
            layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache if caches is None
                                          else caches[index], slots)

        return update

    def _fused_writer(self, layers: list[tuple[int, Any]]
                      ) -> FusedCpuWriter | FusedTritonWriter | None:
        """The fused writer for these layers, decided once: the first whose kernel applies and,
        on a probe, writes exactly what the portable chain writes (``kvwrite.first_exact``)."""
        if self._writer is _UNDECIDED:
            def chain(pieces, positions, slots, scales, caches):
                self._chain.write(pieces, positions, slots, scales,
                                  self._cache_update(layers, caches))
                self._chain.release()

            self._writer = first_exact(
                fused_writers(layers, self._kv_shape[0], self._rope.cos_sin,
                              self._rope.rotary_dim), chain, self._kv_shape, self._block_size)
            log.info("KV writes: %s", self._writer.name if self._writer else "vLLM's ops")
        return self._writer

    def _scale_runs(self, spec: LoadSpec, pieces: list[tuple[torch.Tensor, torch.Tensor, str]]
                    ) -> list[tuple[torch.Tensor | None, int]]:
        """(key scales or None, tokens) per piece: the facts' pieces of a plan that asks for
        key scales take the scales for the plan's number of injected facts, raised to the
        plan's strength."""
        scales = None
        if spec.key_scales > 0 and self._key_scales is not None:
            scales = self._key_scales.for_facts(
                sum(segment.name != PREAMBLE for segment in spec.segments)) ** spec.key_scales
        return [(None if name == PREAMBLE else scales, k.shape[1]) for k, _, name in pieces]

    def _pieces(self, spec: LoadSpec) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """(K, V, segment name): views of the segments' blobs covering positions [start, end),
        each [layers, tokens, heads, dim], checked against the plan and the serving layout."""
        pieces = []
        segments = [segment for segment in spec.segments if segment.end > spec.start]
        blobs = self._store.load_many([s.name for s in segments],  # misses concurrently
                                      [s.checksum for s in segments])
        for segment, blob in zip(segments, blobs, strict=True):
            if not segment.matches(blob.token_ids):
                raise ValueError(f"blob {segment.name} does not match the prompt tokens")
            if blob.k.dtype != self._dtype or (blob.k.shape[0], *blob.k.shape[2:]) != (
                    self._kv_shape):
                raise ValueError(f"blob {segment.name} is {blob.k.dtype} {tuple(blob.k.shape)},"
                                 f" not the serving model's layout")
            skip = max(0, spec.start - segment.start)
            pieces.append((blob.k[:, skip:], blob.v[:, skip:], segment.name))
        if sum(piece[0].shape[1] for piece in pieces) != spec.end - spec.start:
            raise ValueError("the plan's segments do not cover the claimed positions")
        return pieces

    def _slots(self, spec: LoadSpec, positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(spec.block_ids, dtype=torch.long)
        return blocks[positions // self._block_size] * self._block_size + (
            positions % self._block_size)

    def _blocks_of(self, spec: LoadSpec) -> set[int]:
        first, last = spec.start // self._block_size, (spec.end - 1) // self._block_size
        return set(spec.block_ids[first:last + 1])

    def _attention_layers(self, forward_context: ForwardContext) -> list[tuple[int, Any]]:
        """(layer index, attention layer) pairs; the set is static, so it is found once."""
        if self._layers is None:
            layers = []
            for name, layer in forward_context.no_compile_layers.items():
                match = _LAYER_INDEX.search(name)
                if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl") and (
                        match is not None):
                    layers.append((int(match.group(1)), layer))
            self._layers = layers
        return self._layers

    @_never_raises(lambda self: set())
    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def purge(self, locations: list[str]) -> int:
        """Drop blobs from this worker's memory tiers (a forget or an update elsewhere)."""
        return self._store.evict(locations)

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
