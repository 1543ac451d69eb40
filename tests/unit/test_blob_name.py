"""Blob names (``contracts/blob_name.py``): every name parses back to itself, names and
locations written by earlier versions read the same, and no other text is a blob name."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import tried
from inferscale.contracts.blob_name import (
    PREAMBLE,
    BlobName,
    FactId,
    fact_blob,
    lead_blob,
    location_model,
    parse_location,
    with_leads,
)

MODEL = "ab" * 32
FACT_IDS = st.integers(0, 2**63 - 1).map(FactId)
NAMES = st.one_of(st.just(PREAMBLE), FACT_IDS.map(fact_blob), FACT_IDS.map(lead_blob))


@settings(max_examples=500, deadline=None)
@given(NAMES, st.sampled_from([MODEL, MODEL[:16], "f" * 64]))
def test_every_name_and_location_parses_back_to_itself(name, fingerprint):
    assert BlobName.parse(str(name)) == name
    location = name.location(fingerprint)
    assert parse_location(location) == name
    assert location_model(location) == fingerprint[:16] and location.count("/") == 2


def test_names_and_locations_keep_the_format_already_on_disk():
    """``<model[:16]>/<sha1(fact id)[:2]>/<fact id>[.lead].safetensors``: blobs stored before
    this module read back as the same names."""
    shard = hashlib.sha1(b"12").hexdigest()[:2]
    assert (str(fact_blob(FactId(12))), str(lead_blob(FactId(12))), str(PREAMBLE)) == (
        "12", "12.lead", "preamble")
    assert fact_blob(FactId(12)).location(MODEL) == f"{MODEL[:16]}/{shard}/12.safetensors"
    assert lead_blob(FactId(12)).location(MODEL) == f"{MODEL[:16]}/{shard}/12.lead.safetensors"
    preamble_shard = hashlib.sha1(b"preamble").hexdigest()[:2]
    assert PREAMBLE.location(MODEL) == f"{MODEL[:16]}/{preamble_shard}/preamble.safetensors"


def test_a_fact_blobs_location_brings_its_lead_blobs_and_nothing_else_does():
    fact, lead = fact_blob(FactId(7)).location(MODEL), lead_blob(FactId(7)).location(MODEL)
    preamble = PREAMBLE.location(MODEL)
    assert with_leads([fact, fact, lead, preamble, "elsewhere"]) == [fact, lead, preamble,
                                                                     "elsewhere"]


HOSTILE = ["", "preamble.lead", ".lead", "lead", "12.lead.lead", "12.LEAD", "012", "00",
           "-1", "+1", " 1", "1 ", "1_000", "1e3", "0x1f", "١٢", "12\n", "12\0", "../12",
           "12/..", str(2**63), "9" * 5000, "Preamble", "preamble\n"]


@pytest.mark.parametrize("text", HOSTILE)
def test_no_other_text_is_a_blob_name(text):
    tried("blob name parser")
    assert BlobName.parse(text) is None
    assert parse_location(f"{MODEL[:16]}/00/{text}.safetensors") is None


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=30))
def test_any_text_parses_to_nothing_or_to_the_name_it_spells(text):
    tried("blob name parser")
    name = BlobName.parse(text)
    assert name is None or str(name) == text
    assert parse_location(text) is None or text.endswith(".safetensors")


@pytest.mark.parametrize("fact_id", [-1, 2**63, True, 1.0, "1"])
def test_a_name_holds_only_a_fact_id(fact_id):
    with pytest.raises(ValueError):
        BlobName(fact_id)
    with pytest.raises(ValueError):
        BlobName(None, lead=True)  # the preamble has no lead blob
