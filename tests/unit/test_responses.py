"""/v1/responses input items as chat messages, and a reply as output items."""

import json

import pytest

from app.conversations.rendering import BadRequest
from app.conversations.responses import ItemIds, ResponsesRequest, ResponseStream, chat_messages, output_items
from app.protocol import StoredResponse

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
    streamed = ResponsesRequest(input="x", stream=True).chat_body(None)
    assert streamed["stream"] and streamed["stream_options"] == {"include_usage": True}, "usage for the response"


def test_a_reply_becomes_reasoning_message_and_function_call_items():
    message = {"role": "assistant", "content": "ok", "reasoning": "plan",
               "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert [i["type"] for i in output_items(message, ItemIds())] == ["reasoning", "message", "function_call"]
    assert output_items({"role": "assistant", "content": None}, ItemIds())[0]["content"][0]["text"] == ""


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_a_streamed_reply_becomes_responses_events_whose_items_are_the_final_response_s():
    request = ResponsesRequest(input="x", stream=True)
    stream = ResponseStream(request)
    events = _events(stream.opening("m"))
    chunks = [{"choices": [{"delta": {"reasoning": "pl"}}]}, {"choices": [{"delta": {"reasoning": "an"}}]},
              {"choices": [{"delta": {"content": "o"}}]}, {"choices": [{"delta": {"content": "k"}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c9", "function": {"name": "f",
                                                                                         "arguments": "{"}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                            "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                        "prompt_tokens_details": {"cached_tokens": 2}}}]
    for chunk in chunks:
        events += _events(stream.chunk(chunk))
    response, stored = request.response(stream.completion(), [{"role": "user", "content": "x"}], "t",
                                        stream.response_id, stream.ids)
    events += _events(stream.closing(response))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.reasoning_text.done", "response.output_item.done",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [item["id"] for item in response["output"]], "the streamed items are the response's"
    assert [item.get("arguments") or item.get("content") for item in response["output"]][1:] == [
        [{"type": "output_text", "text": "ok", "annotations": []}], "{}"]
    assert events[-1]["response"]["id"] == stored.response_id == stream.response_id
    assert stored.messages[-1] == {"role": "assistant", "content": "ok", "reasoning_content": "plan",
                                   "tool_calls": [{"id": "c9", "type": "function",
                                                   "function": {"name": "f", "arguments": "{}"}}]}


def test_an_empty_streamed_reply_still_gets_its_message_item():
    request = ResponsesRequest(input="x", stream=True)
    stream = ResponseStream(request)
    stream.opening("m")
    stream.chunk({"choices": [{"delta": {}, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1,
                            "prompt_tokens_details": {"cached_tokens": 0}}})
    response, _ = request.response(stream.completion(), [], "t", stream.response_id, stream.ids)
    kinds = [e["type"] for e in _events(stream.closing(response))]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.incomplete"
