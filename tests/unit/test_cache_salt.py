"""Cache salts of memory prompts: keyed by the server's secret, the same for requests of one
owner, pinned facts and class (so they share prefix-cache blocks), and different wherever one
of those differs (so an injected block never serves a request that prefills it by choice);
without pinned facts, different for any other set of facts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.serving.cache_salt import CacheSalts
from inferscale.serving.request_options import MemoryOptions

BASE = MemoryOptions(mode="inject", k=5, recompute=0)
SALTS = CacheSalts("s3cret")


def _salt(options=BASE, owner="alice", retrieved=5, pinned=(3, 9), facts=(3, 9, 20, 21),
          client=None, salts=SALTS):
    return salts.salt(owner, "f" * 64, options, retrieved, pinned, facts, client)


def test_requests_of_one_owner_and_class_share_a_salt_whatever_they_ask():
    """k and the order choose which facts and where; they do not change the kind of KV a place
    gets, so they are not in the salt."""
    same = [BASE.model_copy(update=u) for u in (
        {"k": 5}, {"order": "time"}, {"recompute_margin": 0.1})]
    assert {_salt(options) for options in same} == {_salt()}
    assert _salt(facts=(3, 9, 40, 41)) == _salt()  # with pinned facts: whatever is retrieved
    assert _salt().startswith("inferscale-") and len(_salt()) == len("inferscale-") + 32


def test_every_part_of_the_class_and_every_identity_changes_the_salt():
    changed = [
        _salt(owner="bob"), _salt(retrieved=4), _salt(pinned=(3,)), _salt(pinned=(3, 10)),
        _salt(pinned=()), _salt(pinned=(), facts=(20, 21)), _salt(client="their own"),
        _salt(salts=CacheSalts("another secret")),
        *(_salt(BASE.model_copy(update=u)) for u in (
            {"mode": "text"}, {"recompute": 2}, {"lead": False}, {"key_scales": 0.5},
            {"agent_id": "a"}, {"run_id": "r"}, {"filters": {"agent_id": "a"}},
            {"filters": {"agent_id": "b"}}))]
    # a filter names a scope as agent_id does: a scoped key's prompts (its scope named in a
    # filter) never reuse the blocks of an unscoped prompt holding facts outside that scope
    assert len(set(changed)) == len(changed) and _salt() not in changed


@settings(max_examples=200, deadline=None)
@given(client=st.none() | st.text() | st.integers() | st.lists(st.text(), max_size=3),
       pinned=st.lists(st.integers(1, 2**62), max_size=4))
def test_any_client_salt_and_pinned_ids_give_a_salt_and_never_raise(client, pinned):
    salt = _salt(client=client, pinned=pinned)
    assert salt == _salt(client=client, pinned=list(pinned)) and salt.isascii()


def test_without_pinned_facts_the_salt_names_every_fact_of_the_prompt():
    """So a forgotten, edited or deleted fact's blocks are never reached again (fact ids are
    never reused); with pinned facts, their ids do that for the owner's memory."""
    assert _salt(pinned=(), facts=(20, 21)) != _salt(pinned=(), facts=(20, 22))
    assert _salt(pinned=(), facts=(20, 21)) == _salt(pinned=(), facts=[20, 21])
