"""The injection plan verifier and the connector's scheduler-side check under hostile plans."""

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import json_values, tried
from inferscale.contracts.blob_name import PREAMBLE, BlobName, fact_blob
from inferscale.contracts.plan import (
    PLAN_KEY,
    Plan,
    PlanError,
    Segment,
    _mac,
    sign,
    token_digest,
    verify,
)

SECRET = "s3cret"
FUZZ = settings(max_examples=400, deadline=None)


def _plan() -> Plan:
    return Plan("f" * 64, [Segment.of(PREAMBLE, 0, [1, 2, 3]),
                           Segment.of(fact_blob(7), 3, [4, 5], "c")])


def _signed_body(body: object) -> dict:
    """``body`` signed with the right secret: what only a compromised front end could send."""
    if not isinstance(body, dict):
        body = {"segments": body}
    body = {k: v for k, v in body.items() if k != "sig"}
    return {**body, "sig": _mac(body, SECRET)}


def test_signed_plan_round_trips_and_any_tampering_is_refused():
    signed = sign(_plan(), SECRET)
    assert verify(json.loads(json.dumps(signed)), SECRET) == _plan()
    for key, value in (("fingerprint", "0" * 64), ("segments", []), ("sig", "0" * 64),
                       ("key_scales", 1.0)):
        with pytest.raises(PlanError):
            verify({**signed, key: value}, SECRET)
    with pytest.raises(PlanError):
        verify(signed, "another secret")


def test_a_segment_matches_exactly_its_own_tokens():
    segment = Segment.of(fact_blob(7), 3, [4, 5, 70_000])
    assert segment.end == 6 and segment.matches([4, 5, 70_000])
    assert segment.matches((4, 5, 70_000))  # any sequence of the same ids
    for other in ([4, 5], [4, 5, 70_000, 0], [5, 4, 70_000], [4, 5, 70_000 + 2**32], []):
        assert not segment.matches(other)
    with pytest.raises(OverflowError):
        token_digest([2**63])


def test_key_scale_strength_is_signed_and_must_be_a_number_in_0_1():
    for strength in (1.0, 0.25, 0):
        scaled = Plan("f" * 64, _plan().segments, key_scales=strength)
        assert verify(json.loads(json.dumps(sign(scaled, SECRET))), SECRET).key_scales == strength
    body = {k: v for k, v in sign(_plan(), SECRET).items() if k not in ("sig", "key_scales")}
    assert verify(_signed_body(body), SECRET).key_scales == 0  # absent: not scaled
    for value in (True, 1.5, -0.1, "0.5", None, [1], float("nan"), float("inf")):
        with pytest.raises(PlanError, match="key_scales"):
            verify(_signed_body({**body, "key_scales": value}), SECRET)


def test_the_exact_prefix_is_signed_and_must_lie_within_the_segments():
    exact = Plan("f" * 64, _plan().segments, exact=4)
    assert verify(json.loads(json.dumps(sign(exact, SECRET))), SECRET).exact == 4
    body = {k: v for k, v in sign(_plan(), SECRET).items() if k not in ("sig", "exact")}
    assert verify(_signed_body(body), SECRET).exact == 0  # absent: nothing must be exact
    for value in (True, -1, 6, 2**70, 1.0, "3", None, [1]):
        with pytest.raises(PlanError, match="exact"):
            verify(_signed_body({**body, "exact": value}), SECRET)
    with pytest.raises(PlanError):
        verify({**sign(exact, SECRET), "exact": 0}, SECRET)  # tampered


@FUZZ
@given(data=json_values | st.dictionaries(st.sampled_from(["sig", "fingerprint", "segments"]),
                                          json_values))
def test_unsigned_or_forged_plans_raise_plan_error_only(data):
    tried("plan verifier")
    with pytest.raises(PlanError):
        verify(data, SECRET)


segment_like = st.fixed_dictionaries({}, optional={
    "name": json_values, "start": json_values | st.integers(-3, 10),
    "length": json_values | st.integers(-2, 6),
    "digest": json_values | st.lists(st.integers(-2, 2**70), max_size=4).map(
        lambda ids: token_digest(ids) if all(-2**63 <= t < 2**63 for t in ids) else "x"),
    "checksum": json_values, "extra": json_values})


@FUZZ
@given(body=st.fixed_dictionaries({}, optional={
    "fingerprint": json_values, "segments": json_values | st.lists(segment_like, max_size=4),
    "key_scales": json_values | st.booleans()}))
def test_signed_malformed_plans_raise_plan_error_or_parse_typed(body):
    tried("plan verifier")
    try:
        plan = verify(_signed_body(body), SECRET)
    except PlanError:
        return
    assert isinstance(plan.fingerprint, str) and type(plan.key_scales) is float
    assert 0 <= plan.key_scales <= 1
    for segment in plan.segments:
        assert isinstance(segment.name, BlobName) and type(segment.start) is int
        assert type(segment.length) is int and segment.length >= 1
        assert isinstance(segment.digest, str)


def _scheduler(root, asynchronous=False):
    """The connector's scheduler half without an engine, on an empty durable tier."""
    from inferscale.kv.durable import LocalDir
    from inferscale.kv.store import KVStore
    from inferscale.serving.connector_scheduler import ConnectorScheduler

    return ConnectorScheduler(SECRET, "f" * 64, KVStore(LocalDir(root), "f" * 64, host_bytes=0),
                              asynchronous, block_size=4)


@pytest.fixture(scope="module")
def scheduler_side(tmp_path_factory):
    return _scheduler(tmp_path_factory.mktemp("kv"))


@FUZZ
@given(params=json_values | st.fixed_dictionaries({PLAN_KEY: json_values}) | st.builds(
    lambda body: {PLAN_KEY: _signed_body(body)}, st.fixed_dictionaries({}, optional={
        "fingerprint": st.just("f" * 64) | json_values,
        "segments": st.lists(segment_like, max_size=4)})),
       prompt=st.lists(st.integers(0, 5), max_size=12), computed=st.integers(0, 12))
def test_hostile_plans_never_claim_and_never_raise(scheduler_side, params, prompt, computed):
    tried("connector plan check")
    request = SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=prompt)
    # No blob exists in this store, so no hostile plan may claim a single token; none raises
    # (the connector's guard is a backstop, not the answer).
    assert scheduler_side.matched_tokens(request, computed) == (0, False)
    assert scheduler_side.finished(request)[0] is False


def test_the_plan_check_asks_the_durable_tier_once_per_present_blob(tmp_path, monkeypatch):
    """A blob seen once is trusted for PRESENT_TTL_S (no HEAD request per fact per step on S3);
    a missing one is asked for again, so it is claimed as soon as it is written."""
    import torch

    scheduler_side = _scheduler(tmp_path)
    store = scheduler_side.store
    asked: list[str] = []
    exists = store.durable.exists
    monkeypatch.setattr(store.durable, "exists", lambda loc: asked.append(loc) or exists(loc))
    plan = Plan("f" * 64, [Segment.of(fact_blob(10), 0, [1, 2, 3]),
                           Segment.of(fact_blob(11), 3, [4, 5])])
    request = SimpleNamespace(request_id="p", kv_transfer_params={PLAN_KEY: sign(plan, SECRET)},
                              prompt_token_ids=[1, 2, 3, 4, 5, 6])
    kv = torch.zeros((2, 3, 1, 4), dtype=torch.bfloat16)
    store.put(fact_blob(10), kv, kv.clone(), [1, 2, 3], window=0)
    assert scheduler_side.matched_tokens(request, 0) == (3, False)
    assert len(asked) == 2  # fact 10 found, fact 11 missing
    assert scheduler_side.matched_tokens(request, 0) == (3, False)
    assert len(asked) == 3  # only the missing one again
    store.put(fact_blob(11), kv[:, :2], kv[:, :2].clone(), [4, 5], window=0)
    assert scheduler_side.matched_tokens(request, 0) == (5, False)
    assert scheduler_side.matched_tokens(request, 0) == (5, False)
    assert len(asked) == 4


def _planned(scheduler_side, request_id: str) -> SimpleNamespace:
    """A request whose signed plan injects one stored 3-token fact before a 2-token question."""
    import torch

    kv = torch.zeros((2, 3, 1, 4), dtype=torch.bfloat16)
    stored = scheduler_side.store.put(fact_blob(1), kv, kv.clone(), [1, 2, 3], window=0)
    plan = Plan("f" * 64, [Segment.of(fact_blob(1), 0, [1, 2, 3], stored.checksum)])
    return SimpleNamespace(request_id=request_id, prompt_token_ids=[1, 2, 3, 4, 5],
                           kv_transfer_params={PLAN_KEY: sign(plan, SECRET)})


def _blocks(*groups: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: tuple(groups))


def _step(new=(), block_ids=None) -> SimpleNamespace:
    """A scheduler output scheduling the requests ``new`` (with ``block_ids``) for the first
    time."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=block_ids) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[]))


def test_with_several_kv_cache_groups_a_claim_loads_asynchronously_once(tmp_path):
    """The hybrid manager's path: the claim asks for an asynchronous load, whose spec (every
    group's blocks) goes out in the step that allocates it, and not again when the request is
    scheduled after the load."""
    scheduler_side = _scheduler(tmp_path, asynchronous=True)
    request = _planned(scheduler_side, "a")
    assert scheduler_side.matched_tokens(request, 0) == (3, True)
    scheduler_side.allocated(request, _blocks([5], [0]), 3)
    loads = scheduler_side.step_metadata(_step()).loads
    assert [(spec.request_id, spec.block_ids, spec.asynchronous) for spec in loads] == [
        ("a", [[5], [0]], True)]
    scheduler_side.allocated(request, _blocks([5], [0]), 0)  # after the load: more blocks
    assert scheduler_side.step_metadata(_step(["a"], ([5], [0]))).loads == []
    assert scheduler_side.finished(request) == (False, {"injected_tokens": 3})


def test_a_failed_asynchronous_load_is_never_claimed_again(tmp_path):
    """vLLM recomputes a request whose asynchronous load failed and asks the connector again:
    it gets nothing, and reports no injected tokens."""
    scheduler_side = _scheduler(tmp_path, asynchronous=True)
    request = _planned(scheduler_side, "b")
    assert scheduler_side.matched_tokens(request, 0) == (3, True)
    scheduler_side.allocated(request, _blocks([5], [6]), 3)
    assert len(scheduler_side.step_metadata(_step()).loads) == 1
    scheduler_side.transfers_failed({"b"})
    assert scheduler_side.matched_tokens(request, 0) == (0, False)
    assert scheduler_side.finished(request) == (False, {"injected_tokens": 0})
    assert scheduler_side.matched_tokens(request, 0) == (3, True)  # a new request, same id


def test_with_one_group_a_claim_loads_in_the_step_that_schedules_it(tmp_path):
    scheduler_side = _scheduler(tmp_path)
    request = _planned(scheduler_side, "c")
    assert scheduler_side.matched_tokens(request, 0) == (3, False)
    scheduler_side.allocated(request, _blocks([7]), 3)
    assert scheduler_side.step_metadata(_step()).loads == []  # not scheduled in this step
    loads = scheduler_side.step_metadata(_step(["c"], ([7, 8],))).loads
    assert [(spec.block_ids, spec.asynchronous) for spec in loads] == [([[7, 8]], False)]


def test_a_plan_with_an_exact_prefix_claims_only_after_the_prefix_cache_holds_it(tmp_path):
    """Pinned facts come exact from the engine's prefix cache: with less of them held than
    their last whole block (block size 4 here), the request claims nothing (the engine
    prefills it all, caching them); with that much held, it claims the rest."""
    import torch

    scheduler_side = _scheduler(tmp_path)
    kv = torch.zeros((2, 6, 1, 4), dtype=torch.bfloat16)
    pinned = scheduler_side.store.put(fact_blob(1), kv, kv.clone(), [1, 2, 3, 4, 5, 6], window=0)
    retrieved = scheduler_side.store.put(fact_blob(2), kv[:, :3], kv[:, :3].clone(), [7, 8, 9],
                                         window=0)
    plan = Plan("f" * 64, [Segment.of(fact_blob(1), 0, [1, 2, 3, 4, 5, 6], pinned.checksum),
                           Segment.of(fact_blob(2), 6, [7, 8, 9], retrieved.checksum)], exact=6)
    request = SimpleNamespace(request_id="x", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                              kv_transfer_params={PLAN_KEY: sign(plan, SECRET)})
    for held in (0, 3):  # less than the exact prefix's whole block [0, 4)
        assert scheduler_side.matched_tokens(request, held) == (0, False)
    assert scheduler_side.matched_tokens(request, 4) == (5, False)  # positions 4..8 injected
    assert scheduler_side.matched_tokens(request, 8) == (1, False)
    unpinned = SimpleNamespace(request_id="y", prompt_token_ids=request.prompt_token_ids,
                               kv_transfer_params={PLAN_KEY: sign(
                                   Plan("f" * 64, plan.segments), SECRET)})
    assert scheduler_side.matched_tokens(unpinned, 0) == (9, False)
