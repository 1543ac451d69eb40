"""The export format (``contracts/memory_export.py``): records within bounds are read, anything
else is refused with a ValidationError (never another error), and a version's import key names
it alone."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inferscale.contracts.memory_export import (
    MAX_FACT_CHARS,
    ExportedFact,
    ExportHeader,
    import_key,
    line,
)

NOW = datetime(2026, 12, 6, tzinfo=UTC).isoformat()
GOOD = {"id": 7, "text": "Ada keeps bees.", "conversation_id": "c1", "turn_ids": ["t1"],
        "extractor": "turn", "agent_id": None, "run_id": None, "metadata": {"topic": "bees"},
        "ts": NOW, "created_at": NOW, "deleted_at": None, "superseded_by": None}
HEADER = {"user_id": "ada", "origin": "0" * 32, "exported_at": NOW}


def test_a_record_round_trips_through_a_line():
    record = ExportedFact.model_validate(GOOD)
    assert ExportedFact.model_validate_json(line(record)) == record
    assert line(record).endswith(b"\n") and line(record).count(b"\n") == 1


@pytest.mark.parametrize("change", [
    {"text": ""}, {"text": "x" * (MAX_FACT_CHARS + 1)}, {"text": "a\x00b"}, {"text": "\ud800"},
    {"id": 0}, {"id": 2**63}, {"id": "seven"}, {"conversation_id": ""},
    {"turn_ids": ["t"] * 65}, {"turn_ids": [""]}, {"extractor": "x" * 257},
    {"agent_id": ""}, {"run_id": "r" * 300}, {"metadata": {"": 1}}, {"metadata": [1]},
    {"ts": "2026-12-06T00:00:00"},  # no time zone
    {"created_at": "yesterday"}, {"superseded_by": 9},  # superseded but not retired
    {"superseded_by": 7, "deleted_at": NOW},  # by itself
    {"superseded_by": 3, "deleted_at": NOW},  # by an older version
])
def test_hostile_records_are_refused(change):
    with pytest.raises(ValidationError):
        ExportedFact.model_validate({**GOOD, **change})


@pytest.mark.parametrize("change", [{"origin": "x" * 32}, {"origin": "0" * 31},
                                    {"user_id": ""}, {"user_id": "a\tb"},
                                    {"format": "mem0"}, {"version": 2},
                                    {"exported_at": "2026-12-06T00:00:00"}])
def test_hostile_headers_are_refused(change):
    with pytest.raises(ValidationError):
        ExportHeader.model_validate({**HEADER, **change})


def test_a_retired_version_names_its_successor():
    retired = ExportedFact.model_validate({**GOOD, "deleted_at": NOW, "superseded_by": 8})
    assert retired.superseded_by == 8


def test_an_import_key_names_one_version_of_one_owner_of_one_database():
    header = ExportHeader.model_validate(HEADER)
    assert import_key(header, 7) == import_key(ExportHeader.model_validate(HEADER), 7)
    others = {import_key(header, 8),
              import_key(header.model_copy(update={"user_id": "bob"}), 7),
              import_key(header.model_copy(update={"origin": "1" * 32}), 7)}
    assert import_key(header, 7) not in others and len(others) == 3


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(GOOD)), _JSON, max_size=6))
def test_any_record_is_read_or_refused_with_a_validation_error(changes):
    try:
        ExportedFact.model_validate({**GOOD, **changes})
    except ValidationError:
        pass
