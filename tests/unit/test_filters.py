"""The filter language's parser and Python path, and metadata's bounds (pure logic; the SQL
path against them: tests/integration/test_filters.py)."""

from datetime import UTC, datetime

import pytest

from inferscale.contracts.filters import (
    EVERYTHING,
    MAX_CONDITIONS,
    MAX_DEPTH,
    MAX_LIST,
    FilterError,
    Subject,
    conditions,
    matches,
    parse_filter,
    pinned,
)
from inferscale.contracts.metadata import MAX_KEYS, MAX_METADATA_BYTES, check_metadata

FACT = Subject("alice", "tutor", None, datetime(2025, 3, 1, tzinfo=UTC),
               {"n": 3, "f": 0.5, "flag": True, "city": "Porto", "tags": ["a", 1], "none": None})


@pytest.mark.parametrize("raw, expected", [
    ({}, True),
    ({"user_id": "alice"}, True),
    ({"agent_id": "tutor", "run_id": None}, True),
    ({"run_id": "*"}, False),
    ({"agent_id": {"in": ["x", "tutor"]}}, True),
    ({"agent_id": {"contains": "tut"}}, True),
    ({"n": 3}, True), ({"n": 3.0}, True), ({"n": {"gt": 2, "lte": 3}}, True),
    ({"flag": 1}, False),  # true is not 1
    ({"n": True}, False),
    ({"flag": True}, True),
    ({"none": None}, True), ({"missing": None}, False),
    ({"missing": {"ne": 1}}, True),  # ne is NOT eq
    ({"NOT": {"missing": "*"}}, True),
    ({"city": {"gt": "Paris"}}, True), ({"city": {"gt": 1}}, False),
    ({"city": {"contains": "ort"}}, True), ({"tags": {"contains": 1}}, True),
    ({"tags": {"contains": True}}, False),
    ({"metadata": {"city": "Porto", "n": {"nin": [1, 2]}}}, True),
    ({"created_at": {"gte": "2025-03-01", "lt": "2025-03-01T00:00:01+00:00"}}, True),
    ({"updated_at": {"lt": "2025-03-01"}}, False),
    ({"OR": [{"n": 4}, {"AND": [{"f": 0.5}, {"NOT": [{"city": "Lyon"}]}]}]}, True),
])
def test_the_python_path(raw, expected):
    assert matches(parse_filter(raw), FACT) is expected


@pytest.mark.parametrize("raw, named", [
    ({"app_id": "x"}, "app_id"), ({"categories": {"in": ["x"]}}, "categories"),
    ({"city": {"icontains": "x"}}, "icontains"), ({"city": {"regex": "x"}}, "unknown operator"),
    ({"AND": []}, "non-empty"), ({"AND": {"n": 1}}, "non-empty"), ([1], "JSON object"),
    ({"n": {"gt": True}}, "compares"), ({"agent_id": {"gt": "a"}}, "agent_id"),
    ({"created_at": {"gt": "yesterday"}}, "ISO 8601"), ({"created_at": 5}, "ISO 8601"),
    ({"n": {"in": list(range(MAX_LIST + 1))}}, "at most"), ({"n": {}}, "empty"),
    ({"city": "a\0b"}, "NUL"), ({"city": "\ud800"}, "valid text"), ({"": 1}, "keys"),
    ({"n": float("nan")}, "finite"), ({"n": [1]}, "conditions take"),
])
def test_refusals_name_what_is_refused(raw, named):
    with pytest.raises(FilterError, match=named):
        parse_filter(raw)


def test_filters_are_bounded():
    deep: dict = {"n": 1}
    for _ in range(MAX_DEPTH):
        deep = {"NOT": deep}
    with pytest.raises(FilterError, match="deep"):
        parse_filter(deep)
    with pytest.raises(FilterError, match="conditions"):
        parse_filter({"OR": [{"n": i} for i in range(MAX_CONDITIONS + 1)]})


def test_pinned_names_the_owner_and_scope_only_from_the_top_conjunction():
    assert pinned(parse_filter({"AND": [{"user_id": "alice"}, {"agent_id": "t", "n": 1}]})) == {
        "user_id": "alice", "agent_id": "t"}
    assert pinned(parse_filter({"OR": [{"user_id": "alice"}, {"user_id": "bob"}]})) == {}
    assert pinned(parse_filter({"NOT": {"user_id": "alice"}})) == {}
    assert pinned(parse_filter({"AND": [{"agent_id": "a"}, {"agent_id": "b"}]})) == {}


@pytest.mark.parametrize("metadata, named", [
    ({"k": "x" * MAX_METADATA_BYTES}, "bytes"),
    ({"a": {"b": {"c": {"d": {"e": 1}}}}}, "deep"),
    ({"a": [[[[1]]]]}, "deep"),
    ({f"k{i}": i for i in range(MAX_KEYS + 1)}, "keys"),
    ({"k": "a\0b"}, "NUL"), ({"k": "\udcff"}, "valid text"), ({"a\tb": 1}, "keys"),
    ({"k" * 129: 1}, "keys"), ({"": 1}, "keys"),
    ({"k": float("inf")}, "finite"), ({"k": 2**64}, "64 bits"), ({"k": {1, 2}}, "JSON values"),
])
def test_metadata_bounds(metadata, named):
    with pytest.raises(ValueError, match=named):
        check_metadata(metadata)


def test_metadata_within_the_bounds_is_kept_as_given():
    metadata = {"a": {"b": {"c": [1, 2.5, "x", None, True]}}, "é": "ü" * 100}
    assert check_metadata(metadata) is metadata


def test_a_filters_cost_per_fact_is_its_number_of_conditions():
    assert conditions(EVERYTHING) == 0
    assert conditions(parse_filter({"a": 1})) == 1
    assert conditions(parse_filter({"OR": [{"a": i} for i in range(64)]})) == 64
    assert conditions(parse_filter({"NOT": {"a": {"gt": 1, "lt": 5}}, "agent_id": "x",
                                    "AND": [{"b": "*"}, {"OR": [{"c": 1}, {"d": 2}]}]})) == 6
