"""The Responses API (`POST /v1/responses`) on the chat path: a response's input items become chat
messages appended to the conversation its `previous_response_id` names, and the reply comes back as
output items (reasoning, message, function calls).

    input items ──chat_messages()──▶ chat request ──the chat path (records, append rendering)──▶ reply
    reply ──output_items()──▶ response;  stored: the conversation's chat messages, in the KV index

The stored conversation holds the messages, never tokens: the chat path keeps the exact tokens of
every turn in its records, keyed by those messages, so a continued response renders as an append
to them. Stored responses live in the KV index (any router replica reads them; bounded by count,
bytes, tenant share and `conversation_ttl_s` like the records), and one tenant's id names nothing
for another tenant (404). Function calls and their outputs are stored like any message.
"""

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.chat import BadRequest
from app.protocol import StoredResponse

STREAMING_REFUSED = ("stream: streamed responses are not implemented here (stream the same turn from "
                     "/v1/chat/completions)")


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's (and vLLM's) ResponsesRequest this server honours; the others that ask
    for something are refused by name (the router's check against vLLM's own model)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    logit_bias: dict[str, float] | None = None

    def chat_body(self, previous: StoredResponse | None) -> dict[str, Any]:
        """The chat request this response is: the stored conversation plus the new items."""
        if self.stream:
            raise BadRequest(STREAMING_REFUSED)
        if previous is None:
            messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        else:
            messages = list(previous.messages)
            if self.instructions and messages[:1] != [{"role": "system", "content": self.instructions}]:
                raise BadRequest("instructions: only a conversation's first response sets them here")
        messages += chat_messages([{"role": "user", "content": self.input}] if isinstance(self.input, str)
                                  else self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "user": self.user,
                                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                                "logit_bias": self.logit_bias}
        if self.tools:
            body["tools"] = [chat_tool(tool) for tool in self.tools]
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        return {name: value for name, value in body.items() if value is not None}

    def response(self, completion: dict[str, Any], conversation: list[dict[str, Any]],
                 tenant: str) -> tuple[dict[str, Any], StoredResponse]:
        """The response body for a chat completion of `chat_body`, and what to store of it."""
        response_id = f"resp_{uuid.uuid4().hex}"
        choice, usage = completion["choices"][0], completion["usage"]
        message = choice["message"]
        incomplete = choice["finish_reason"] == "length"
        body = {"id": response_id, "object": "response", "created_at": completion["created"],
                "model": completion["model"], "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output_items(message), "previous_response_id": self.previous_response_id,
                "instructions": self.instructions, "tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
                "top_p": self.top_p, "max_output_tokens": self.max_output_tokens, "store": self.store,
                "metadata": self.metadata or {}, "error": None,
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                          "total_tokens": usage["total_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens_details": {"reasoning_tokens": 0}}}
        replayed = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            replayed["tool_calls"] = message["tool_calls"]
        if message.get("reasoning"):
            replayed["reasoning_content"] = message["reasoning"]
        messages = (*conversation, replayed)
        return body, StoredResponse(response_id, tenant, messages, time.time(), len(json.dumps(messages)))


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls join the assistant message before
    them, their outputs become tool messages; reasoning items are left out (the record keeps the
    reasoning tokens the model produced)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "")}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
        elif kind != "reasoning":
            raise BadRequest(f"input: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output, reasoning)")
    return messages


def _text(content: Any) -> str:
    if isinstance(content, list):
        kinds = {part.get("type") for part in content} - {"input_text", "output_text", "text"}
        if kinds:
            raise BadRequest(f"input: content parts of type {', '.join(sorted(map(str, kinds)))} are not supported")
        return "".join(part.get("text", "") for part in content)
    return content or ""


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise BadRequest(f"tools: tools of type {tool.get('type')!r} are not supported (function)")
    function = {name: tool[name] for name in ("name", "description", "parameters", "strict") if name in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning"]}]})
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": message.get("content") or "",
                                   "annotations": []}]})
    for call in message.get("tool_calls") or ():
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items
