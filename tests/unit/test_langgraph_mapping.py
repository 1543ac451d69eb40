"""The LangGraph store's mapping of items to facts (pure logic): the text a fact says, the
metadata that holds the item within the API's bounds, LangGraph's filters in the API's filter
language, and namespace matching."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langgraph.store.base import MatchCondition

from inferscale.contracts.filters import parse_filter
from inferscale.contracts.metadata import check_metadata
from inferscale_client.langgraph_store import (
    fact_text,
    item_metadata,
    matches,
    owner_of,
    value_filter,
)

LABEL = st.text(min_size=1, max_size=12).filter(lambda s: "\x00" not in s)


def test_the_text_is_the_index_fields_else_a_text_field_else_the_value_as_json():
    value = {"text": "Ines teaches.", "topic": "work", "n": 2}
    assert fact_text(value, ["topic", "n"]) == "work\n2"
    assert fact_text(value, None) == fact_text(value, ["$"]) == "Ines teaches."
    assert fact_text({"memory": "Likes tea."}, ["absent"]) == "Likes tea."
    assert json.loads(fact_text({"a": [1, 2]}, None)) == {"a": [1, 2]}


@given(st.lists(LABEL, min_size=1, max_size=4).map(tuple), LABEL,
       st.dictionaries(st.text(min_size=1, max_size=10).filter(str.isidentifier),
                       st.none() | st.booleans() | st.integers(-2**53, 2**53)
                       | st.text(max_size=20).filter(lambda s: "\x00" not in s), max_size=5))
def test_an_items_metadata_is_valid_metadata_and_filters_on_it_parse(namespace, key, value):
    metadata = item_metadata(namespace, key, value)
    assert check_metadata(metadata) == metadata
    assert json.loads(metadata["langgraph.value"]) == value
    assert json.loads(metadata["langgraph.namespace"]) == list(namespace)
    parse_filter({"langgraph.prefixes": {"contains": metadata["langgraph.prefixes"][0]},
                  **value_filter({name: {"$gte": 1} for name in value})})


def test_langgraph_filters_map_to_the_api_language_and_unknown_operators_are_named():
    assert value_filter({"kind": "pet", "rank": {"$gte": 2, "$lt": 5}}) == {
        "value.kind": "pet", "value.rank": {"gte": 2, "lt": 5}}
    with pytest.raises(ValueError, match=r"\$in"):
        value_filter({"kind": {"$in": ["pet"]}})


def test_namespaces_match_prefixes_and_suffixes_with_wildcards():
    ns = ("ines", "projects", "a")
    assert matches(ns, [MatchCondition("prefix", ("ines", "*"))])
    assert matches(ns, [MatchCondition("suffix", ("projects", "a"))])
    assert not matches(ns, [MatchCondition("prefix", ("bob",))])
    assert not matches(ns, [MatchCondition("suffix", ("x", "ines", "projects", "a"))])
    assert owner_of(ns) == "ines"
    for empty in ((), ("",)):
        with pytest.raises(ValueError, match="owner"):
            owner_of(empty)
