"""A Responses API request (``/v1/responses``) as the chat its memory prompt is composed of.

vLLM's own conversion makes the messages (``instructions`` as the system message, then the
stored history of ``previous_response_id``, then ``input``: a string, or message, tool call
and tool output items), so a memory prompt holds the conversation vLLM would have rendered;
``compose.chat_messages`` then takes them as it takes a chat's. The history of a previous
response is vLLM's own store (``VLLM_ENABLE_RESPONSES_API_STORE``): where it holds none, the
request is a 404 as vLLM answers it, never an answer without the history or the memory asked
for. The request's validation is vLLM's model's: a body vLLM would refuse is a 400 here.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from inferscale.serving.guards import FrontendError


def response_messages(data: dict[str, Any], history: tuple[list, list] | None
                      ) -> list[dict[str, Any]]:
    """The chat messages of a Responses request ``data``, after ``history`` (the previous
    response's stored messages and output items; None: no previous response)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages
    from vllm.exceptions import VLLMClientError

    try:
        request = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = ".".join(map(str, error["loc"])) or "request"
        raise FrontendError(400, f"invalid Responses request field {name[:80]!r}: "
                                 f"{error['msg'][:200]}") from None
    previous, output = history if history is not None else (None, None)
    try:
        messages = construct_input_messages(request_instructions=request.instructions,
                                            request_input=request.input, prev_msg=previous,
                                            prev_response_output=output)
    except (VLLMClientError, ValueError) as exc:
        raise FrontendError(400, f"invalid Responses input: {str(exc)[:200]}") from None
    return [dict(m) for m in messages]


async def stored_history(app: Any, response_id: str) -> tuple[list, list]:
    """The stored messages and output items of the response ``response_id`` in vLLM's store
    (404 where it holds none: the store is off, or the id unknown or expired)."""
    serving = getattr(getattr(app, "state", None), "openai_serving_responses", None)
    if serving is None:
        raise FrontendError(404, f"previous response {response_id[:80]!r} not found: this "
                                 f"server answers no Responses API")
    async with serving.response_store_lock:
        response = serving.response_store.get(response_id)
    if response is None:
        raise FrontendError(404, f"previous response {response_id[:80]!r} not found (vLLM "
                                 f"keeps responses only with VLLM_ENABLE_RESPONSES_API_STORE=1)")
    return list(serving.msg_store.get(response_id) or []), list(response.output)
