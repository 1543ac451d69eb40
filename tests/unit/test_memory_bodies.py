"""The memory API's request bodies refuse what Postgres cannot store or the API does not mean,
before any work: NUL and lone surrogates in any text, an edit that changes nothing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inferscale.serving.memory_api import EditBody, NewFactBody


@pytest.mark.parametrize("field", ["text", "conversation_id"])
@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", ""])
def test_a_new_fact_refuses_text_postgres_cannot_store(field, bad):
    with pytest.raises(ValidationError):
        NewFactBody.model_validate({"text": "Ines keeps bees.", field: bad})


def test_a_new_fact_may_be_pinned_and_an_edit_may_only_pin():
    assert NewFactBody.model_validate({"text": "Ines keeps bees.", "pinned": True}).pinned
    assert EditBody.model_validate({"pinned": False}).pinned is False
    with pytest.raises(ValidationError):
        EditBody.model_validate({})
    with pytest.raises(ValidationError):
        NewFactBody.model_validate({"text": "Ines keeps bees.", "pinned": "yes please"})


@settings(max_examples=200, deadline=None)
@given(conversation=st.text(max_size=300))
def test_any_conversation_id_is_taken_whole_or_refused(conversation):
    try:
        body = NewFactBody.model_validate({"text": "x", "conversation_id": conversation})
    except ValidationError:
        return
    assert body.conversation_id == conversation and "\x00" not in conversation
    conversation.encode()  # storable: valid UTF-8


def test_mem0s_output_format_is_taken_only_for_the_format_served():
    """Mem0's TypeScript client sends ``output_format: "v1.1"`` with every search."""
    from inferscale.serving.mem0_api import SearchBody

    assert SearchBody.model_validate({"query": "q", "user_id": "u", "output_format": "v1.1"})
    with pytest.raises(ValidationError, match="output_format"):
        SearchBody.model_validate({"query": "q", "user_id": "u", "output_format": "v1.0"})


def test_a_mem0_update_keeps_clears_or_sets_the_expiry_as_its_body_says():
    from datetime import UTC, datetime

    from inferscale.serving.mem0_api import BatchItem, UpdateBody

    assert UpdateBody.model_validate({"text": "x"}).expiry is ...  # absent: as it was
    assert UpdateBody.model_validate({"expiration_date": None}).expiry is None  # cleared
    assert UpdateBody.model_validate({"expiration_date": "2030-01-31"}).expiry == datetime(
        2030, 2, 1, tzinfo=UTC)  # served through that day
    assert BatchItem.model_validate({"memory_id": "1", "expiration_date": None}).expiry is None
    for bad in ({}, {"expiration_date": "soon"}, {"expiration_date": 5},
                {"text": "x", "timestamp": 5}):
        with pytest.raises(ValidationError):
            UpdateBody.model_validate(bad)


def test_every_mem0_route_is_under_a_mem0_prefix():
    """Mem0's ``Token`` header and the browser's JSON rule hold on exactly these prefixes."""
    from inferscale.serving.mem0_api import MEM0_PREFIXES, router

    paths = [route.path for route in router.routes]
    assert paths and all(path.startswith(MEM0_PREFIXES) for path in paths), paths
