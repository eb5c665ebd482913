"""An agent loop through the real app: tool calls parsed by vLLM's own parser (hermes, Qwen3's JSON
calls), tool results in the history, and every turn after a tool result an append to the previous
turn's exact tokens. The oracle: one plain vLLM engine fed the same prompt ids and the grammar
vLLM's parser builds for the same request; its text, parsed by that parser, gives the same calls."""

import json
from dataclasses import replace

import pytest
import ray
from openai import OpenAI

from tests.integration.conftest import SYSTEM_PROMPT, decisions_by_request, run_own_app

pytestmark = pytest.mark.integration
MAX_TOKENS = 128
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
# strict: vLLM holds the arguments of a required or named call to the schema (its structural tag)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "strict": True,
                                            "parameters": {"type": "object", "properties": {"city": CITY},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "strict": True,
                                         "parameters": {"type": "object", "properties": {"city": CITY},
                                                        "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BODY = {"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def no_blank_json(app_config) -> dict[str, float]:
    """The embedded model's blank_token_bias, for the app and the oracle alike."""
    from transformers import AutoTokenizer

    from app.model.tiny import blank_token_bias

    return blank_token_bias(AutoTokenizer.from_pretrained(str(app_config.model_path())))


def _vllm_parser(model_path: str, strict_level: str):
    from transformers import AutoTokenizer
    from vllm.parser import ParserManager

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer, ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True,
                                               tool_strict_level=strict_level, tokenizer=tokenizer)


def _vllm_request(messages: list[dict], tool_choice, tools: list[dict], response_format: dict | None) -> object:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="tiny-qwen3", messages=messages, tools=tools, tool_choice=tool_choice,
                                 response_format=response_format)


def _turn(client: OpenAI, messages: list[dict], tool_choice, stream: bool, bias: dict[str, float],
          tools: list[dict] = TOOLS, response_format: dict | None = None) -> dict:
    """One turn as the app answers it: the message, its token ids and the response's id."""
    kwargs = dict(model="tiny-qwen3", messages=messages, tools=tools, tool_choice=tool_choice, temperature=0,
                  max_tokens=MAX_TOKENS, logit_bias=bias, extra_body=BODY,
                  **({"response_format": response_format} if response_format else {}))
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        choice = response["choices"][0]
        return {"id": response["id"], "message": choice["message"], "finish_reason": choice["finish_reason"],
                "prompt_ids": response["prompt_token_ids"], "output_ids": choice["token_ids"]}
    chunks = [c.model_dump() for c in client.chat.completions.create(**kwargs, stream=True)]
    calls: dict[int, dict] = {}
    for delta in (c["choices"][0]["delta"] for c in chunks if c["choices"]):
        for call in delta.get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"id": call["id"], "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += (call.get("function") or {}).get("name") or ""
            entry["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return {"id": chunks[0]["id"], "finish_reason": next(c["choices"][0]["finish_reason"] for c in reversed(chunks)
                                                          if c["choices"] and c["choices"][0]["finish_reason"]),
            "message": {"role": "assistant", "content": content, "tool_calls": [calls[i] for i in sorted(calls)]},
            "prompt_ids": next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")),
            "output_ids": [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or ()]}


def _oracle(reference, app_config, turn: dict, messages: list[dict], tool_choice, bias: dict[str, float],
            stream: bool, tools: list[dict] = TOOLS, response_format: dict | None = None) -> tuple[list[int], list]:
    """The plain engine's ids for the turn's prompt under vLLM's grammar for the request (its server
    run with the app's `tool_strict_level`), and the calls vLLM's parser reads in its text: whole, or
    token by token as vLLM's server streams them (its streamed arguments are the model's text, its
    whole ones re-serialized)."""
    tokenizer, parser_cls = _vllm_parser(str(app_config.model_path()), app_config.tool_strict_level)
    request = _vllm_request(messages, tool_choice, tools, response_format)
    request = parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None).adjust_request(
        request=request)
    ids, text = ray.get(reference.replies.remote([turn["prompt_ids"]], MAX_TOKENS, None, {
        "ignore_eos": False, "structured_outputs": request.structured_outputs, "logit_bias": bias,
        "skip_special_tokens": request.skip_special_tokens}))[0]
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)
    if not stream:
        _, _, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
        return ids, [{"name": c.name, "arguments": c.arguments} for c in calls or ()]
    streamed: dict[int, dict] = {}
    shown = ""
    for i, token in enumerate(ids):
        piece = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)[len(shown):]
        shown += piece
        delta = parser.parse_delta(delta_text=piece, delta_token_ids=[token], request=request,
                                   prompt_token_ids=turn["prompt_ids"], finished=i == len(ids) - 1)
        for call in delta.tool_calls if delta else ():
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or "" if call.function else ""
            entry["arguments"] += call.function.arguments or "" if call.function else ""
    return ids, [streamed[i] for i in sorted(streamed)]


def test_an_agent_loop_s_tool_turns_equal_the_plain_engine_s_and_append_to_their_history(
        client, http, reference, app_config, no_blank_json):
    messages = [{"role": "system", "content": f"Tools. {SYSTEM_PROMPT}"},
                {"role": "user", "content": "What is the weather in Paris, and the time?"}]
    turns = []
    for k, (choice, stream) in enumerate([(NAMED, False), ("required", True), ("auto", False)]):
        turn = _turn(client, messages, choice, stream, no_blank_json)
        ids, calls = _oracle(reference, app_config, turn, messages, choice, no_blank_json, stream)
        assert turn["output_ids"] == ids, f"turn {k}"
        got = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
               for c in turn["message"].get("tool_calls") or ()]
        assert got == calls, f"turn {k}: the calls vLLM's parser reads in the plain engine's reply"
        turns.append(turn)
        if choice == "auto":
            break
        assert got and all(c["name"] in ("get_weather", "get_time") for c in got), turn["message"]
        assert json.loads(got[0]["arguments"])["city"] in CITY["enum"]
        assert turn["finish_reason"] == ("stop" if choice is NAMED else "tool_calls")
        messages = [*messages, {"role": "assistant", "content": turn["message"]["content"],
                                "tool_calls": turn["message"]["tool_calls"]},
                    *({"role": "tool", "tool_call_id": c["id"], "content": f"{c['function']['name']}: 21 C, 14:05"}
                      for c in turn["message"]["tool_calls"])]
    decisions = decisions_by_request(http)
    for previous, current in zip(turns, turns[1:]):
        sequence = previous["prompt_ids"] + previous["output_ids"]
        assert current["prompt_ids"][:len(sequence)] == sequence, "the tool turn appends to the exact history"
        rendering = decisions[current["id"]]["rendering"]
        assert rendering["cause"] == "none" and rendering["shared_tokens"] == len(sequence), rendering
        assert rendering["pause_s"] > 0, "the decision log says how long the tool ran before the reuse"


def _streamed_events(http, no_blank_json, **fields) -> list[dict]:
    body = {"model": "tiny-qwen3", "messages": [{"role": "system", "content": f"Stream. {SYSTEM_PROMPT}"},
                                                {"role": "user", "content": "The weather in Rome?"}],
            "tools": TOOLS, "tool_choice": NAMED, "temperature": 0, "max_tokens": 48, "logit_bias": no_blank_json,
            "stream": True, "stream_options": {"include_usage": True}, **fields}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_a_streamed_tool_call_opens_with_vllm_s_role_chunk_and_its_prompt_ids(http, no_blank_json):
    """vLLM's server sends the role chunk at the reply's first output, before its parser yields
    any of the call: a client timing its first chunk sees the reply begin."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseStreamChoice

    events = _streamed_events(http, no_blank_json, return_token_ids=True)
    first, rest = events[0], [e for e in events[1:] if e["choices"]]
    role = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""),
                                              logprobs=None, finish_reason=None)
    assert first["choices"] == [role.model_dump(exclude_unset=True)]
    assert first["prompt_token_ids"] and not any(e.get("prompt_token_ids") for e in rest)
    assert not any("role" in e["choices"][0]["delta"] for e in rest), "later deltas name no role, as vLLM's"
    assert any(e["choices"][0]["delta"].get("tool_calls") for e in rest)


def test_a_streamed_tool_call_s_logprobs_cover_every_token(http, no_blank_json):
    """Chunks whose tokens the parser holds back still carry their logprobs, as vLLM's server sends them."""
    events = _streamed_events(http, no_blank_json, logprobs=True, top_logprobs=1)
    steps = [step for e in events if e["choices"] for step in (e["choices"][0].get("logprobs") or {}).get(
        "content") or ()]
    assert len(steps) == events[-1]["usage"]["completion_tokens"] > 0


def test_tools_the_request_does_not_offer_or_bad_tool_choices_are_a_400(http):
    base = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for body, field in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "forces a tool call")):
        response = http.post("/v1/chat/completions", json={**base, **body})
        assert response.status_code == 400 and field in response.json()["error"]["message"], response.text


def test_an_auto_tool_choice_with_a_response_format_answers_under_vllm_s_merged_grammar(
        client, reference, app_config, no_blank_json):
    """A call or a reply in the asked format, whichever the model takes, as vLLM's server allows."""
    answer = {"type": "object", "properties": {"city": CITY}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    messages = [{"role": "system", "content": f"Tools or JSON. {SYSTEM_PROMPT}"},
                {"role": "user", "content": "Which city is warmest?"}]
    turn = _turn(client, messages, "auto", False, no_blank_json, response_format=fmt)
    ids, calls = _oracle(reference, app_config, turn, messages, "auto", no_blank_json, False, response_format=fmt)
    assert turn["output_ids"] == ids
    got = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
           for c in turn["message"].get("tool_calls") or ()]
    assert got == calls
    assert got or json.loads(turn["message"]["content"])["city"] in CITY["enum"], turn["message"]


@pytest.fixture(scope="module")
def parameter_strict(app_config, base_url):
    """The app again, as vLLM's server run with `--tool-strict-level parameter`."""
    return run_own_app(base_url, replace(app_config, tool_strict_level="parameter"))


@pytest.mark.own_app
def test_tool_strict_level_parameter_holds_tools_without_strict_to_their_schema(
        parameter_strict, client, reference, no_blank_json):
    """Tools as most agent frameworks send them, without `strict`: under vLLM's default their
    arguments are free JSON (the random weights answer `null`); here they follow the schema, with
    the same ids and calls as the plain engine under vLLM's grammar for that level."""
    loose = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in TOOLS]
    messages = [{"role": "system", "content": f"Loose tools. {SYSTEM_PROMPT}"},
                {"role": "user", "content": "What is the weather in Oslo?"}]
    for stream in (False, True):
        turn = _turn(client, messages, NAMED, stream, no_blank_json, loose)
        ids, calls = _oracle(reference, parameter_strict, turn, messages, NAMED, no_blank_json, stream, loose)
        assert turn["output_ids"] == ids, f"stream={stream}"
        got = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
               for c in turn["message"]["tool_calls"]]
        assert got == calls and json.loads(got[0]["arguments"])["city"] in CITY["enum"], (stream, got)
