"""The connector's scheduler half, in vLLM's EngineCore process: which prompt tokens to inject.

It authenticates a request's signed plan (``contracts/plan.py``), checks every segment's prompt
tokens against the plan's digests and that its blob exists, and claims the memory span
(preamble + injected facts) minus the local prefix-cache hit, never the last prompt token (vLLM
must compute one). A plan whose first positions must be exact (``Plan.exact``: pinned facts)
claims nothing unless the local hit covers them to their last whole block: the engine then
prefills the whole prompt, exact, and its prefix cache holds them for the next request.
Claims reach the worker half as per-step metadata: ids and positions only, never KV. Nothing
here raises on a hostile plan: it claims nothing instead.

Two ways to load, by the engine's KV cache groups (``connector.asynchronous``). With one group
of full attention, loads are synchronous: the worker writes before the forward pass of the step
that prefills the request, and a failed load's blocks are recomputed. Otherwise (vLLM's hybrid
KV cache manager, or a sliding window: local layers keep only their window's blocks) a failed
block cannot be recomputed by block, so failures are taken per request, from an asynchronous
load: the request waits one engine step while the worker writes its KV (in the step that admits
it), then prefills; a failed load makes vLLM recompute the whole request, which is never claimed
again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachetools import TTLCache
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale.contracts.blob_name import BlobName
from inferscale.contracts.plan import PLAN_KEY, Plan, PlanError, Segment, verify
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.kv.store import KVStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("inferscale.serving.connector")
# How long the scheduler trusts that a blob it saw is still there. A blob never changes under
# its name, and one deleted since only costs a recompute of its blocks (the load fails), so the
# plan check does not ask the durable tier (one HEAD request per fact on S3) at every step.
PRESENT_TTL_S = 60.0
PRESENT_MAX = 100_000


@dataclass
class LoadSpec:
    """Positions ``[start, end)`` of one request to fill from ``segments`` into its blocks,
    ``block_ids[group]`` per KV cache group (block 0, vLLM's null block: none kept there);
    ``key_scales``: the strength the facts' keys are scaled with (the plan's; 0: unscaled);
    ``asynchronous``: reported done or failed per request, else failed per block."""

    request_id: str
    start: int
    end: int
    segments: list[Segment]
    block_ids: list[list[int]] = field(default_factory=list)
    key_scales: float = 0.0
    asynchronous: bool = False


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    """Per-step metadata: ids and positions only, never KV."""

    loads: list[LoadSpec] = field(default_factory=list)


class ConnectorScheduler:
    """Claims the memory span of requests whose plan checks out; one per EngineCore."""

    def __init__(self, secret: str, fingerprint: str, store: KVStore,
                 asynchronous: bool = False, block_size: int = 16) -> None:
        """``store``: the durable tier is asked whether blobs exist (no memory tiers here);
        ``asynchronous``: load asynchronously (``connector.asynchronous``); ``block_size``:
        the engine's KV block (prefix-cache hits are whole blocks)."""
        self.secret = secret
        self.fingerprint = fingerprint
        self.store = store
        self.asynchronous = asynchronous
        self.block_size = block_size
        self._pending: dict[str, LoadSpec] = {}  # claimed, blocks not yet scheduled
        self._allocated: dict[str, LoadSpec] = {}  # asynchronous claims given their blocks
        self._claimed: dict[str, int] = {}  # request -> injected tokens, until it finishes
        self._refused: set[str] = set()  # asynchronous loads that failed: never claimed again
        self._present: TTLCache[BlobName, bool] = TTLCache(PRESENT_MAX, PRESENT_TTL_S)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: how many tokens after the local prefix hit
        this request gets injected (0 without a valid plan)."""
        with KV_METRICS.stage_seconds.labels("plan_check").time():
            return self._match(request, num_computed_tokens)

    def _plan_for(self, request: Request) -> Plan | None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return None
        try:
            plan = verify(params[PLAN_KEY], self.secret)
        except PlanError as exc:
            log.warning("request %s: plan refused: %s", request.request_id, exc)
            return None
        if plan.fingerprint != self.fingerprint:
            log.warning("request %s: plan for another model", request.request_id)
            return None
        return plan

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._refused:
            return 0, False
        plan = self._plan_for(request)
        if plan is None or num_computed_tokens < plan.exact - plan.exact % self.block_size:
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
        self._pending[request.request_id] = LoadSpec(
            request.request_id, num_computed_tokens, end, segments,
            key_scales=plan.key_scales, asynchronous=self.asynchronous)
        return end - num_computed_tokens, self.asynchronous

    def _blob_present(self, name: BlobName) -> bool:
        """Whether the durable blob ``name`` exists; positives are remembered (see above)."""
        if name not in self._present and self.store.exists(name):
            self._present[name] = True
        return name in self._present

    def drop(self, request: Request) -> None:
        """Forget any claim of this request (the claim-nothing answer after a failure)."""
        self._pending.pop(request.request_id, None)

    def allocated(self, request: Request, blocks: KVCacheBlocks,
                  num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the claim's blocks (or its withdrawal). An
        asynchronous claim's blocks are final here: its load goes out in this step."""
        spec = self._pending.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens <= 0:
            del self._pending[request.request_id]
            return
        spec.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._claimed[request.request_id] = num_external_tokens
        if spec.asynchronous:
            self._allocated[request.request_id] = self._pending.pop(request.request_id)

    def step_metadata(self, scheduler_output: SchedulerOutput) -> InferScaleMetadata:
        """vLLM's ``build_connector_meta``: the loads of the asynchronous claims given their
        blocks in this step, and of the synchronous claims scheduled in this step (new
        requests, or resumed ones with their new blocks)."""
        meta = InferScaleMetadata(loads=list(self._allocated.values()))
        self._allocated.clear()
        scheduled = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        resumed = {req_id: cached.new_block_ids[i] for i, req_id in enumerate(cached.req_ids)
                   if req_id in cached.resumed_req_ids}
        for req_id in list(self._pending):
            spec = self._pending[req_id]
            if req_id in scheduled:
                spec.block_ids = [list(ids) for ids in scheduled[req_id].block_ids]
            elif req_id in resumed and resumed[req_id] is not None:
                spec.block_ids = [list(ids) for ids in resumed[req_id]]
            else:
                continue
            meta.loads.append(spec)
            del self._pending[req_id]
        return meta

    def transfers_failed(self, request_ids: set[str]) -> None:
        """vLLM's ``update_connector_output``: asynchronous loads the worker failed. vLLM
        recomputes those requests; they are never claimed again and inject nothing."""
        for request_id in request_ids:
            self._refused.add(request_id)
            self._claimed.pop(request_id, None)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: blocks are freed at once; a planned request reports how
        many tokens were injected (``kv_transfer_params`` of the response)."""
        self._pending.pop(request.request_id, None)
        self._allocated.pop(request.request_id, None)
        self._refused.discard(request.request_id)
        injected = self._claimed.pop(request.request_id, 0)
        params = request.kv_transfer_params
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return False, None
        return False, {"injected_tokens": injected}
