"""Lead blobs by need (pure logic): which facts the encode stage gives a lead blob, and the
served order that puts one of them first."""

from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.contracts.blob_name import holds_lead
from inferscale.db.reads import RetrievedFact
from inferscale.serving.compose import lead_first


def test_the_lead_share_is_a_stable_hash_of_the_fact_id():
    ids = range(1, 20_001)
    chosen = [i for i in ids if holds_lead(i, 0.25)]
    assert 0.23 < len(chosen) / len(ids) < 0.27
    # Every worker, every process, every version: the choice is part of what is stored.
    assert [i for i in range(1, 41) if holds_lead(i, 0.25)] == [3, 9, 14, 16, 21, 25, 30, 38]
    # Runs of consecutive ids (one conversation's facts) are not all in or all out.
    assert all(0 < sum(holds_lead(i, 0.25) for i in range(s, s + 40)) < 40
               for s in range(1, 2_000, 40))
    assert all(holds_lead(i, 1.0) for i in ids) and not any(holds_lead(i, 0.0) for i in ids)
    assert set(chosen) <= {i for i in ids if holds_lead(i, 0.5)}  # shares nest


def fact(i: int, lead: bool) -> RetrievedFact:
    return RetrievedFact(i, f"fact {i}", 0.1, [i], f"loc/{i}", f"c{i}", f"l{i}" if lead else None)


@settings(max_examples=300, deadline=None)
@given(leads=st.lists(st.booleans(), max_size=30), tail=st.integers(0, 35))
def test_the_least_relevant_fact_with_a_lead_goes_first_outside_the_tail(leads, tail):
    facts = [fact(i, lead) for i, lead in enumerate(leads)]  # best last
    served = lead_first(facts, tail)
    assert sorted(f.id for f in served) == [f.id for f in facts]
    head = max(len(facts) - tail, 0)
    assert served[head:] == facts[head:]  # the recomputed tail keeps its place
    candidates = [f for f in facts[:head] if f.kv_lead_checksum]
    if not candidates:
        assert served == facts
        return
    assert served[0] == candidates[0]
    assert served[1:] == [f for f in facts if f != candidates[0]]  # the rest keep their order
