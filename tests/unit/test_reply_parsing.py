"""Tool calls and reasoning told apart by vLLM's own parsers, and the replayed message as the record's key."""

import json

import pytest

from app.conversations.openai_api import ChatCompletionRequest
from app.conversations.records import message_chain
from app.conversations.rendering import BadRequest
from app.conversations.reply_parsing import ReplyParsing
from app.model.tiny import ensure_tiny_model
from app.protocol import SamplingSettings

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def _parsing(tokenizer, reasoning=""):
    return ReplyParsing(tokenizer, "hermes", reasoning, "tiny-qwen3", "auto", 4)


def _body(**fields):
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                                    **fields})


def test_a_named_or_required_tool_choice_gets_vllm_s_structural_tag(tokenizer):
    parsing = _parsing(tokenizer)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        sampling = parsing.constrain(_body(tool_choice=choice), SamplingSettings())
        assert "get_weather" in json.loads(sampling.structural_tag)["format"]["tags"][0]["begin"], choice
        assert sampling.reads_reply and not sampling.skip_special_tokens
    auto = parsing.constrain(_body(), SamplingSettings())
    assert auto.structural_tag is None and not auto.reads_reply


@pytest.mark.parametrize("level, schema", [("auto", True), ("parameter", WEATHER["function"]["parameters"])])
def test_tool_strict_level_holds_a_tool_without_strict_to_its_schema_as_vllm_s_server_does(tokenizer, level, schema):
    """The tool is not marked `strict`: under vLLM's default its call's arguments are free JSON
    (random weights answer `null`), under "parameter" they are held to its schema."""
    parsing = ReplyParsing(tokenizer, "hermes", "", "tiny-qwen3", level, 4)
    sampling = parsing.constrain(_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                                 SamplingSettings())
    assert json.loads(sampling.structural_tag)["format"]["tags"][0]["content"]["json_schema"] == schema


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.mark.parametrize("level", ["auto", "parameter"])
def test_an_auto_tool_choice_and_a_structured_output_get_vllm_s_merged_grammar(tokenizer, level):
    """Either a call or a reply in the asked format, as vLLM's server builds it for the same request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VLLMRequest

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = _body(tools=[strict], response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    parsing = ReplyParsing(tokenizer, "hermes", "", "tiny-qwen3", level, 4)
    sampling = parsing.constrain(body, body.sampling(64, {}))
    vllm = VLLMRequest(model="tiny-qwen3", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[strict],
                       tool_choice="auto",
                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    vllm = parsing._parser(vllm).adjust_request(request=vllm)
    assert sampling.structural_tag == vllm.structured_outputs.structural_tag and sampling.json_schema is None
    assert json.loads(sampling.structural_tag)["format"]["type"] == "or"


def test_an_agent_loop_s_constraint_is_built_once_and_equals_vllm_s_each_turn(tokenizer, monkeypatch):
    """Its tools and choice are the same every turn, its messages are not (vLLM's parsers do not read them)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    fresh = _parsing(tokenizer).constrain(_body(tool_choice=named), SamplingSettings())
    parsing, built = _parsing(tokenizer), []
    constraint = parsing._constraint
    monkeypatch.setattr(parsing, "_constraint", lambda *args: built.append(1) or constraint(*args))
    turns = [_body(tool_choice=named, messages=[{"role": "user", "content": f"Weather in {k}?"}]) for k in range(3)]
    assert all(parsing.constrain(body, SamplingSettings()) == fresh for body in turns) and len(built) == 1
    parsing.constrain(_body(tool_choice="required"), SamplingSettings())
    assert len(built) == 2, "another choice is another constraint"


def test_a_tool_whose_properties_come_in_another_order_gets_its_own_constraint(tokenizer):
    """vLLM's tag keeps the schema's order, and the grammar holds a call's arguments to it."""
    def tool(*names):
        properties = {name: {"type": "string"} for name in names}
        return {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": properties, "required": ["city"]}, "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsing = _parsing(tokenizer)
    for names in (("city", "day"), ("day", "city")):
        body = _body(tools=[tool(*names)], tool_choice=named)
        assert parsing.constrain(body, SamplingSettings()) == _parsing(tokenizer).constrain(body, SamplingSettings())


def test_a_forced_call_with_a_structured_output_is_refused_where_vllm_would_drop_the_output(tokenizer):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = _body(tool_choice=choice, response_format={"type": "json_object"})
        with pytest.raises(BadRequest, match="forces a tool call"):
            _parsing(tokenizer).constrain(body, body.sampling(64, {}))
    alone = _body(response_format={"type": "json_object"}, tool_choice="none")
    assert _parsing(tokenizer).constrain(alone, alone.sampling(64, {})).json_object


def test_vllm_s_request_checks_refuse_a_tool_choice_that_names_no_offered_tool(tokenizer):
    with pytest.raises(BadRequest, match="tool_choice"):
        _parsing(tokenizer).constrain(_body(tool_choice={"type": "function", "function": {"name": "other"}}),
                                      SamplingSettings())
    with pytest.raises(BadRequest, match="tool_call_parser"):
        ReplyParsing(tokenizer, "", "", "tiny-qwen3", "auto", 4).constrain(_body(), SamplingSettings())


def test_a_reply_s_tool_calls_parsed_whole_and_streamed_agree(tokenizer):
    parsing, text = _parsing(tokenizer), "Let me look." + CALL
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = parsing.vllm_request(_body())
    message, called = parsing.message(request, text, ids)
    assert called and message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    stream, deltas, shown = parsing.stream(parsing.vllm_request(_body(stream=True))), [], ""
    for i, token in enumerate(ids):
        piece = tokenizer.decode(ids[: i + 1])[len(shown):]
        shown += piece
        deltas.append(stream.delta(piece, [token], [], finished=i == len(ids) - 1))
    calls = [c for d in deltas if d for c in d.get("tool_calls", ())]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Paris"}'
    assert "".join(d.get("content", "") for d in deltas if d) == "Let me look."
    assert stream.finish_reason("stop") == "tool_calls"


def test_reasoning_is_apart_from_content_with_a_reasoning_parser(tokenizer):
    parsing, text = _parsing(tokenizer, "qwen3"), "<think>\nplan\n</think>\n\nHello"
    request = parsing.vllm_request(ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}]))
    message, called = parsing.message(request, text, tokenizer.encode(text, add_special_tokens=False))
    assert (message["reasoning"].strip(), message["content"].strip(), called) == ("plan", "Hello", False)


def test_a_replayed_reply_keys_its_record_however_the_client_spells_it():
    """Reasoning in content, in a field of its own or dropped; arguments re-serialized; ids of
    the client's own: the same message, so the same record."""
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": [2]}'}}
    respelled = {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"y":[2],"x":1}'}}
    spellings = [{"role": "assistant", "content": "<think>\nplan\n</think>\n\nok", "tool_calls": [call]},
                 {"role": "assistant", "content": "ok", "reasoning_content": "plan", "tool_calls": [respelled]},
                 {"role": "assistant", "content": "ok", "tool_calls": [call]}]
    assert len({message_chain("t", [m])[0] for m in spellings}) == 1
    renamed = {**call, "function": {"name": "g", "arguments": "{}"}}
    other = {"role": "assistant", "content": "ok", "tool_calls": [renamed]}
    assert message_chain("t", [other]) != message_chain("t", spellings[:1])
