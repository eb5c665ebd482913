"""/v1/responses through the real app with the official client: a function call, its output sent
alone with `previous_response_id`, and the continued response an append to the exact tokens of the
first (the stored conversation is messages; the chat path's record holds the tokens). Another
tenant's key cannot continue it. Streamed, the events arrive as the reply is made, the completed
response is stored, and the openai-agents SDK's default model (the Responses API) runs its loop."""

import time

import pytest

from tests.integration.conftest import SYSTEM_PROMPT, make_client
from tests.integration.test_tool_calls import CITY, no_blank_json  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                          "additionalProperties": False}}


def test_a_function_call_s_output_continues_the_stored_response_as_an_append(base_url, http, no_blank_json):  # noqa: F811
    client, started = make_client(base_url), time.time()
    common = dict(model="tiny-qwen3", tools=[WEATHER], temperature=0, max_output_tokens=128,
                  extra_body={"logit_bias": no_blank_json})
    first = client.responses.create(input="What is the weather in Paris?", instructions=f"Responses. {SYSTEM_PROMPT}",
                                    tool_choice={"type": "function", "name": "get_weather"}, **common)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and calls[0].name == "get_weather", first.output
    second = client.responses.create(previous_response_id=first.id, tool_choice="none", **common, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}])
    assert second.output and second.output[-1].type == "message" and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    turns = [d for d in http.get("/admin/decisions", params={"n": 50}).json() if d["time"] >= started]
    rendering = turns[-1]["rendering"]
    assert rendering["cause"] == "none" and rendering["shared_tokens"] == rendering["previous_tokens"] > 0, rendering

    other = make_client(base_url, "key-b")
    with pytest.raises(Exception) as refused:
        other.responses.create(previous_response_id=first.id, input="And Rome?", **common)
    assert getattr(refused.value, "status_code", None) == 404


def test_a_streamed_response_is_events_as_the_reply_is_made_and_is_stored(base_url, http, no_blank_json):  # noqa: F811
    client = make_client(base_url)
    common = dict(model="tiny-qwen3", tools=[WEATHER], temperature=0, max_output_tokens=128,
                  extra_body={"logit_bias": no_blank_json})
    events = list(client.responses.create(input="What is the weather in Rome?", stream=True,
                                           instructions=f"Streamed responses. {SYSTEM_PROMPT}",
                                           tool_choice={"type": "function", "name": "get_weather"}, **common))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and kinds.count("response.output_item.done") >= 1
    first = events[-1].response
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and first.usage.output_tokens > 0
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments, "the deltas add up to the call"
    second = list(client.responses.create(previous_response_id=first.id, tool_choice="none", stream=True, **common,
                                          input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                  "output": "18 C"}]))
    text = "".join(e.delta for e in second if e.type == "response.output_text.delta")
    done = second[-1].response
    assert done.output[-1].content[0].text == text and done.previous_response_id == first.id
    rendering = http.get("/admin/decisions", params={"n": 1}).json()[-1]["rendering"]
    assert rendering["cause"] == "none" and rendering["shared_tokens"] == rendering["previous_tokens"] > 0, rendering
