"""/v1/responses input items as chat messages, and a reply as output items."""

import pytest

from app.chat import BadRequest
from app.protocol import StoredResponse
from app.responses import ResponsesRequest, chat_messages, output_items

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}


def test_function_calls_join_their_assistant_message_and_outputs_become_tool_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "reasoning", "summary": []}, CALL, {**CALL, "call_id": "c2"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"}]
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"] and messages[2]["tool_call_id"] == "c1"
    with pytest.raises(BadRequest, match="web_search_call"):
        chat_messages([{"type": "web_search_call"}])


def test_a_continued_response_is_the_stored_conversation_plus_what_is_new():
    stored = StoredResponse("resp_1", "t", ({"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "a"}), 0.0, 10)
    body = ResponsesRequest(input="next", previous_response_id="resp_1",
                            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                            tool_choice={"type": "function", "name": "f"}).chat_body(stored)
    assert body["messages"][-1] == {"role": "user", "content": "next"} and len(body["messages"]) == 4
    assert body["tools"][0]["function"]["name"] == "f" and body["tool_choice"]["function"] == {"name": "f"}
    with pytest.raises(BadRequest, match="instructions"):
        ResponsesRequest(input="x", instructions="other").chat_body(stored)
    with pytest.raises(BadRequest, match="stream"):
        ResponsesRequest(input="x", stream=True).chat_body(None)


def test_a_reply_becomes_reasoning_message_and_function_call_items():
    message = {"role": "assistant", "content": "ok", "reasoning": "plan",
               "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert [i["type"] for i in output_items(message)] == ["reasoning", "message", "function_call"]
    assert output_items({"role": "assistant", "content": None})[0]["content"][0]["text"] == ""
