"""Who may read or change memory (``serving/access.py``, pure logic): keys as permissions, the
right key getting through as well as the wrong one refused, and the rate limit per key."""

import pytest
from pydantic import ValidationError

from inferscale.contracts.scope import ANY, Scope
from inferscale.core.settings import Settings
from inferscale.serving.access import Access
from inferscale.serving.guards import FrontendError

KEYS = {
    "admin": ["*"],
    "alice-key": ["alice"],
    "reader": {"owners": ["alice"], "read_only": True},
    "agent-key": {"owners": ["alice"], "agents": ["planner"]},
    "run-key": {"owners": ["alice"], "agents": ["planner"], "runs": ["r1", "r2"]},
}


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _status(access: Access, key: str | None, owner: str, **kw) -> int:
    try:
        access.authorize(_bearer(key) if key is not None else {}, owner, **kw)
    except FrontendError as exc:
        return exc.status
    return 200


@pytest.fixture
def access() -> Access:
    return Access(Settings(api_keys=KEYS, rate_limit=None))


@pytest.mark.parametrize(("key", "owner", "kw", "status"), [
    ("admin", "anyone", {}, 200),
    ("admin", "anyone", {"write": True}, 200),
    ("alice-key", "alice", {"write": True}, 200),
    ("alice-key", "bob", {}, 403),
    (None, "alice", {}, 401),
    ("wrong", "alice", {}, 401),
    ("alice-key ", "alice", {}, 200),  # the header's surrounding blanks are not the key
    ("ALICE-KEY", "alice", {}, 401),
    ("reader", "alice", {}, 200),
    ("reader", "alice", {"write": True}, 403),
    ("agent-key", "alice", {"scope": Scope("planner")}, 200),
    ("agent-key", "alice", {"scope": Scope("planner", "any-run")}, 200),
    ("agent-key", "alice", {"scope": ANY}, 403),  # a filter it may not widen
    ("agent-key", "alice", {"scope": Scope("coder")}, 403),
    ("agent-key", "alice", {"scope": None}, 200),  # the route checks each fact's scope
    ("run-key", "alice", {"scope": Scope("planner", "r2")}, 200),
    ("run-key", "alice", {"scope": Scope("planner")}, 403),
    ("run-key", "alice", {"scope": Scope("planner", "r3")}, 403),
])
def test_keys_are_permissions(access, key, owner, kw, status):
    assert _status(access, key, owner, **kw) == status


def test_other_schemes_and_empty_bearers_are_no_key(access):
    for header in ("Basic YWRtaW46", "admin", "Bearer", "Bearer    ", "Token admin"):
        with pytest.raises(FrontendError) as refused:
            access.authorize({"authorization": header}, "alice")
        assert refused.value.status == 401


@pytest.mark.parametrize("key", ["", " ", "a b", "tab\tkey", "nul\0key"])
def test_keys_no_header_can_match_are_refused_at_start(key):
    with pytest.raises(ValidationError):
        Settings(api_keys={key: ["*"]})


def test_only_unrestricted_keys_are_admin(access):
    access.authorize_control(_bearer("admin"))
    for key, status in (("alice-key", 403), ("reader", 403), ("agent-key", 403), ("x", 401)):
        with pytest.raises(FrontendError) as refused:
            access.authorize_control(_bearer(key))
        assert refused.value.status == status


def test_anonymous_only_where_chosen():
    with pytest.raises(FrontendError) as refused:
        Access(Settings()).authorize({}, "alice")
    assert refused.value.status == 401
    anonymous = Access(Settings(allow_anonymous=True))
    assert anonymous.authorize({}, "alice", write=True).admin
    anonymous.authorize_control({})


def test_the_rate_limit_holds_per_key_and_says_when_to_retry():
    access = Access(Settings(api_keys=KEYS, rate_limit="3/minute"))
    for _ in range(3):
        access.authorize(_bearer("alice-key"), "alice")
    with pytest.raises(FrontendError) as limited:
        access.authorize(_bearer("alice-key"), "alice")
    assert limited.value.status == 429
    assert 1 <= int(limited.value.headers["retry-after"]) <= 60
    for _ in range(5):  # admin keys (the operator's, the local one) are not limited
        access.authorize(_bearer("admin"), "alice")
    limited_reader = Access(Settings(api_keys=KEYS, rate_limit="1/minute"))
    limited_reader.authorize(_bearer("reader"), "alice")  # another key has its own budget
    with pytest.raises(FrontendError) as unknown:  # refusals are not counted against a key
        access.authorize(_bearer("nope"), "alice")
    assert unknown.value.status == 401


def test_anonymous_callers_are_limited_per_address():
    access = Access(Settings(allow_anonymous=True, rate_limit="1/minute"))
    access.authorize({}, "alice", client="10.0.0.1")
    access.authorize({}, "alice", client="10.0.0.2")
    with pytest.raises(FrontendError) as limited:
        access.authorize({}, "alice", client="10.0.0.1")
    assert limited.value.status == 429


def test_costly_requests_count_by_their_cost_and_key_checks_count_too():
    access = Access(Settings(api_keys=KEYS, rate_limit="10/minute"))
    access.authorize(_bearer("alice-key"), "alice", write=True, cost=8)  # an import of 8
    access.known(_bearer("alice-key"), None)  # a route that names no owner (entities, ping)
    access.authorize(_bearer("alice-key"), "alice")
    with pytest.raises(FrontendError) as limited:
        access.known(_bearer("alice-key"), None)
    assert limited.value.status == 429
    whole = Access(Settings(api_keys=KEYS, rate_limit="10/minute"))
    whole.authorize(_bearer("alice-key"), "alice", cost=1000)  # takes a whole window, no more
    with pytest.raises(FrontendError) as over:
        whole.authorize(_bearer("alice-key"), "alice")
    assert over.value.status == 429


def test_lookups_of_ids_not_ones_own_have_their_own_limit():
    access = Access(Settings(api_keys=KEYS, rate_limit="2/minute"))
    access.missed(_bearer("alice-key"), None)
    access.missed(_bearer("alice-key"), None)
    with pytest.raises(FrontendError) as limited:
        access.missed(_bearer("alice-key"), None)
    assert limited.value.status == 429
    access.authorize(_bearer("alice-key"), "alice")  # the request budget is another one
    for _ in range(5):
        access.missed(_bearer("admin"), None)


def test_waiting_reads_are_capped_per_key_and_freed_when_done():
    access = Access(Settings(api_keys=KEYS, max_waits_per_key=2))
    with access.waiting(_bearer("alice-key"), None), access.waiting(_bearer("alice-key"), None):
        with pytest.raises(FrontendError) as full, access.waiting(_bearer("alice-key"), None):
            pass
        assert full.value.status == 429 and full.value.headers["retry-after"]
        with access.waiting(_bearer("reader"), None):  # another key has its own slots
            pass
    with access.waiting(_bearer("alice-key"), None):  # freed again
        pass
    with pytest.raises(FrontendError) as unknown, access.waiting(_bearer("nope"), None):
        pass
    assert unknown.value.status == 401


@pytest.mark.parametrize("uri", ["", "memory", "ftp://x", "async+memory://", "redis:/x"])
def test_a_rate_limit_store_limits_cannot_use_is_refused_at_start(uri):
    with pytest.raises(ValidationError):
        Settings(rate_limit_storage=uri)


@pytest.mark.parametrize("spec", ["lots", "5/fortnight", "-1/second"])
def test_a_rate_limit_the_notation_cannot_read_is_refused_at_start(spec):
    with pytest.raises(ValidationError):
        Settings(rate_limit=spec)


def test_grants_as_lists_or_objects_and_nothing_else():
    settings = Settings(api_keys=KEYS)
    assert settings.api_keys["alice-key"].owners == ["alice"]
    assert settings.api_keys["reader"].read_only
    for bad in ({"k": []}, {"k": {"owners": ["a"], "write": True}}, {"k": "alice"},
                {"k": {"agents": ["a"]}}):
        with pytest.raises(ValidationError):
            Settings(api_keys=bad)


def test_secrets_stay_out_of_the_settings_repr():
    """Settings show up in tracebacks and logs: their keys and secrets do not."""
    shown = repr(Settings(api_keys={"key-in-repr": ["*"]}, vllm_api_keys=["vllm-in-repr"],
                          plan_secret="plan-in-repr", llm_api_key="llm-in-repr"))
    for secret in ("key-in-repr", "vllm-in-repr", "plan-in-repr", "llm-in-repr"):
        assert secret not in shown
