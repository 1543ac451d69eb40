"""Per-request memory options: body over headers over settings, and anything else a 400 that
names the option."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import json_values, tried
from inferscale.contracts.filters import EVERYTHING
from inferscale.core.settings import Settings
from inferscale.serving.guards import FrontendError
from inferscale.serving.request_options import (
    MAX_K,
    MemoryOptions,
    default_recompute,
    owner_and_options,
)

SERVER = Settings(top_k=7, recompute_tail=1, fact_order="time", lead_encoding=False,
                  key_scale_strength=0.5)


def test_settings_then_headers_then_the_body_decide():
    owner, options = owner_and_options({"user": "ana"}, {}, SERVER)
    assert owner == "ana" and options == MemoryOptions(mode="inject", k=7, recompute=1,
                                                       order="time", lead=False, key_scales=0.5)
    headers = {"x-inferscale-k": "3", "x-inferscale-memory": "text",
               "x-inferscale-lead": "true", "x-inferscale-key-scales": "false"}
    _, options = owner_and_options({"user": "ana"}, headers, SERVER)
    assert (options.k, options.mode, options.lead, options.key_scales) == (3, "text", True, 0.0)
    body = {"user": "ana", "inferscale": {"k": 5, "mode": "none", "key_scales": 0.25,
                                          "order": None}}
    _, options = owner_and_options(body, headers, SERVER)
    assert (options.k, options.mode, options.key_scales, options.order) == (5, "none", 0.25,
                                                                           "time")
    assert "inferscale" not in body  # the options never reach vLLM


def test_no_owner_means_no_memory_and_key_scales_off_means_zero():
    owner, options = owner_and_options({}, {}, Settings(key_scales="off"))
    assert owner is None and options.key_scales == 0.0


@pytest.mark.parametrize(("given", "named"), [
    ({"mode": "telepathy"}, "mode"), ({"k": -1}, "k"), ({"k": MAX_K + 1}, "k"),
    ({"k": "two"}, "k"), ({"recompute": 10**30}, "recompute"), ({"recompute": [1]}, "recompute"),
    ({"order": "random"}, "order"), ({"order": 3}, "order"), ({"order": {"by": "time"}}, "order"),
    ({"lead": "maybe"}, "lead"), ({"lead": "yes"}, "lead"), ({"lead": 2}, "lead"),
    ({"lead": 1}, "lead"), ({"lead": [True]}, "lead"), ({"lead": {"on": 1}}, "lead"),
    ({"key_scales": "half"}, "key_scales"), ({"key_scales": -0.1}, "key_scales"),
    ({"key_scales": "1e999"}, "key_scales"), ({"key_scales": 10**400}, "key_scales"),
    ({"key_scales": [0.9]}, "key_scales"), ({"key_scales": {"layer": 1}}, "key_scales"),
    ({"k": 2.5}, "k"), ({"recompute": "two"}, "recompute"),
    ({"key_scales": 1.5}, "key_scales"), ({"key_scales": "nan"}, "key_scales"),
    ({"key_scales": float("inf")}, "key_scales"),
    ({"recompute": "always"}, "recompute"), ({"recompute": "AUTO"}, "recompute"),
    ({"recompute_margin": -0.1}, "recompute_margin"),
    ({"recompute_margin": "nan"}, "recompute_margin"),
    ({"recompute_margin": [1]}, "recompute_margin"),
    ({"recompute_text_margin": -1}, "recompute_text_margin"),
    ({"recompute_text_margin": "inf"}, "recompute_text_margin"),
    ({"agent_id": ""}, "agent_id"), ({"agent_id": 7}, "agent_id"),
    ({"agent_id": "a\x00"}, "agent_id"), ({"run_id": "r" * 257}, "run_id"),
    ({"run_id": ["r"]}, "run_id"),
    ({"colour": "red"}, "colour"),
    ({"filters": "topic = pets"}, "filters"), ({"filters": {"AND": "x"}}, "filters"),
    ({"filters": {"created_at": {"gte": "yesterday"}}}, "filters"),
    ({"filters": {"topic": {"regex": ".*"}}}, "filters")])
def test_bad_options_are_a_400_naming_the_option(given, named):
    with pytest.raises(FrontendError) as refused:
        owner_and_options({"user": "ana", "inferscale": given}, {}, SERVER)
    assert refused.value.status == 400 and named in refused.value.message


def test_recompute_takes_a_count_or_auto_and_its_default_follows_the_device(monkeypatch):
    import torch

    _, options = owner_and_options({"user": "ana", "inferscale": {"recompute": "auto"}}, {},
                                   SERVER)
    assert options.recompute == "auto"
    _, options = owner_and_options({"user": "ana"}, {"x-inferscale-recompute": "auto"}, SERVER)
    assert options.recompute == "auto"
    device_default = Settings(recompute_tail=None, recompute_auto_tail=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert owner_and_options({"user": "ana"}, {}, device_default)[1].recompute == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the tail is cheap on a GPU
    assert owner_and_options({"user": "ana"}, {}, device_default)[1].recompute == 3
    assert default_recompute(Settings(recompute_tail="auto")) == "auto"


def test_a_filter_comes_from_the_body_only_and_is_parsed():
    _, read = owner_and_options({"user": "ana", "inferscale": {
        "filters": {"AND": [{"topic": "pets"}, {"created_at": {"gte": "2025-01-01"}}]}}},
        {"x-inferscale-filters": "ignored"}, SERVER)
    assert read.where != EVERYTHING and read.filters["AND"][0] == {"topic": "pets"}
    _, plain = owner_and_options({"user": "ana"}, {}, SERVER)
    assert plain.filters is None and plain.where == EVERYTHING


def test_scope_comes_from_the_body_or_the_headers():
    _, options = owner_and_options({"user": "ana", "inferscale": {"agent_id": "coach"}},
                                   {"x-inferscale-run-id": "s1"}, SERVER)
    assert (options.scope.agent_id, options.scope.run_id) == ("coach", "s1")
    _, options = owner_and_options({"user": "ana"}, {}, SERVER)
    assert options.scope.items() == []


@pytest.mark.parametrize(("header", "value"), [("x-inferscale-lead", "maybe"),
                                               ("x-inferscale-key-scales", "2"),
                                               ("x-inferscale-k", "-1"),
                                               ("x-inferscale-memory", "telepathy")])
def test_bad_option_headers_are_a_400(header, value):
    with pytest.raises(FrontendError) as refused:
        owner_and_options({"user": "ana"}, {header: value}, SERVER)
    assert refused.value.status == 400


@pytest.mark.parametrize("owner", ["", "x" * 257, 5, ["ana"], {"id": "ana"}])
def test_a_bad_owner_is_a_400(owner):
    with pytest.raises(FrontendError) as refused:
        owner_and_options({"user": owner}, {}, SERVER)
    assert refused.value.status == 400


@settings(max_examples=300, deadline=None)
@given(options=json_values | st.dictionaries(
    st.sampled_from(["mode", "k", "recompute", "recompute_margin", "recompute_text_margin",
                     "order", "lead",
                     "key_scales", "agent_id", "run_id", "filters"]), json_values),
       headers=st.dictionaries(st.sampled_from(["x-inferscale-k", "x-inferscale-lead",
                                                "x-inferscale-key-scales", "x-inferscale-user",
                                                "x-inferscale-agent-id",
                                                "x-inferscale-run-id",
                                                "x-inferscale-recompute",
                                                "x-inferscale-recompute-margin",
                                                "x-inferscale-recompute-text-margin"]),
                               st.text(max_size=12)))
def test_hostile_options_are_read_or_refused_with_a_400(options, headers):
    tried("front end: memory options")
    try:
        _, read = owner_and_options({"user": "ana", "inferscale": options}, headers, SERVER)
    except FrontendError as exc:
        assert exc.status == 400
    else:
        assert 0 <= read.k <= MAX_K
        assert 0.0 <= read.key_scales <= 1.0
        assert read.recompute == "auto" or 0 <= read.recompute <= MAX_K
        assert 0.0 <= read.recompute_margin < float("inf")
        assert 0.0 <= read.recompute_text_margin < float("inf")
        assert all(0 < len(value) <= 256 and "\x00" not in value
                   for _, value in read.scope.items())
        read.where  # noqa: B018 - a filter that was read parses


def test_memory_asked_of_another_generation_route_is_a_400_naming_it():
    """Memory is served on chat completions and responses only: /v1/completions and vLLM's
    other generation routes refuse a request that asks for it (body object, owner header or an
    option's header), and let through one that does not (``user`` is OpenAI's end-user id)."""
    from inferscale.serving.request_options import WITHOUT_MEMORY, refuse_memory_elsewhere

    for path in sorted(WITHOUT_MEMORY):
        for data, headers in (({"inferscale": {"k": 3}}, {}), ({}, {"x-inferscale-user": "a"}),
                              ({"prompt": "hi"}, {"x-inferscale-k": "3"})):
            with pytest.raises(FrontendError) as refused:
                refuse_memory_elsewhere(path, data, headers)
            assert refused.value.status == 400 and path in refused.value.message
        refuse_memory_elsewhere(path, {"prompt": "hi", "user": "alice"}, {})
        refuse_memory_elsewhere(path, ["not", "an", "object"], {})
    for served in ("/v1/chat/completions", "/v1/responses"):
        assert served not in WITHOUT_MEMORY
        refuse_memory_elsewhere(served, {"inferscale": {"k": 3}}, {"x-inferscale-user": "a"})
    refuse_memory_elsewhere("/v1/memory/users/a/facts", {"inferscale": 1},
                            {"x-inferscale-user": "a"})  # the memory API's own routes
