"""A Responses API request as the chat its memory prompt is composed of: vLLM's conversion of
instructions, history and input items, then the chat's own checks; bad input is a 400 naming
it, a previous response the store does not hold a 404."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale.serving.compose import chat_messages
from inferscale.serving.guards import FrontendError
from inferscale.serving.responses_input import response_messages, stored_history


def chat(data: dict, history=None) -> tuple[list[dict], str]:
    return chat_messages({"messages": response_messages(data, history)})


def test_instructions_and_a_string_input_are_a_system_and_a_user_message():
    messages, query = chat({"input": "Where does Ines teach?", "instructions": "Be brief."})
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Where does Ines teach?"}]
    assert query == "Where does Ines teach?"


def test_message_items_with_text_parts_and_tool_items_become_the_chat_vllm_renders():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "My horse?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Biscuit.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "And the weather?"},
    ]
    messages, query = chat({"input": items})
    # vLLM merges the call into the assistant message before it
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "system", "user"]
    assert messages[0]["content"] == "My horse?" and messages[1]["content"] == "Biscuit."
    assert messages[2]["content"] == "sunny" and query == "And the weather?"


def test_the_previous_response_comes_before_the_input_and_its_instructions_do_not_carry():
    previous = [{"role": "system", "content": "Old rules."},
                {"role": "user", "content": "My horse is Biscuit."}]
    output = [SimpleNamespace()]  # not a message: vLLM skips it (as it skips reasoning)
    messages, query = chat({"input": "What is my horse called?", "instructions": "New rules."},
                           (previous, output))
    assert [m["content"] for m in messages] == ["New rules.", "My horse is Biscuit.",
                                                "What is my horse called?"]
    assert query == "What is my horse called?"


@pytest.mark.parametrize("data", [
    {"input": 7},
    {"input": [{"type": "no_such_item"}]},
    {"input": "hi", "max_output_tokens": "many"},
    {"input": "hi", "instructions": ["not", "text"]},
])
def test_a_request_vllm_would_refuse_is_a_400(data):
    with pytest.raises(FrontendError) as refused:
        response_messages(data, None)
    assert refused.value.status == 400


def test_an_image_or_no_question_is_refused_as_a_chat_is():
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    for data in ({"input": [image]}, {"input": [], "instructions": "Be brief."}):
        with pytest.raises(FrontendError) as refused:
            chat(data)
        assert refused.value.status == 400


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["role", "type", "content", "text",
                                                       "output", "call_id"]), inner,
                                      max_size=4), max_leaves=12))
def test_any_input_is_a_chat_or_a_400(value):
    try:
        messages, query = chat({"input": value})
    except FrontendError as refused:
        assert refused.status == 400
        return
    assert isinstance(query, str) and messages and json.dumps(messages)


def _app(responses: dict, messages: dict):
    serving = SimpleNamespace(response_store_lock=asyncio.Lock(), response_store=responses,
                              msg_store=messages)
    return SimpleNamespace(state=SimpleNamespace(openai_serving_responses=serving))


def test_the_history_is_vllms_store_and_a_response_it_does_not_hold_is_a_404():
    stored = SimpleNamespace(output=["item"])
    app = _app({"resp_1": stored}, {"resp_1": [{"role": "user", "content": "Hi"}]})
    assert asyncio.run(stored_history(app, "resp_1")) == ([{"role": "user", "content": "Hi"}],
                                                          ["item"])
    for app_, response_id in ((app, "resp_2"), (_app({}, {}), "resp_1"),
                              (SimpleNamespace(state=SimpleNamespace()), "resp_1")):
        with pytest.raises(FrontendError) as missing:
            asyncio.run(stored_history(app_, response_id))
        assert missing.value.status == 404
