"""The Responses API (`POST /v1/responses`) on the chat path: a response's input items become chat
messages appended to the conversation its `previous_response_id` names, and the reply comes back as
output items (reasoning, message, function calls).

    input items ──chat_messages()──▶ chat request ──the chat path (records, append rendering)──▶ reply
    reply ──output_items()──▶ response;  stored: the conversation's chat messages, in the KV index
    streamed: chat chunks ──ResponseStream──▶ the Responses API's events, `response.completed` last

The stored conversation holds the messages, never tokens: the chat path keeps the exact tokens of
every turn in its records, keyed by those messages, so a continued response renders as an append
to them. Stored responses live in the KV index (any router replica reads them; bounded by count,
bytes, tenant share and `conversation_ttl_s` like the records), and one tenant's id names nothing
for another tenant (404). Function calls and their outputs are stored like any message.
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.conversations.rendering import BadRequest
from app.protocol import StoredResponse


@dataclass
class ItemIds:
    """A response's output item ids, made once so that streamed events and the final response agree."""

    reasoning: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    message: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    calls: list[str] = field(default_factory=list)

    def call(self, index: int) -> str:
        while len(self.calls) <= index:
            self.calls.append(f"fc_{uuid.uuid4().hex}")
        return self.calls[index]


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
                                "logit_bias": self.logit_bias, "stream": self.stream,
                                "stream_options": {"include_usage": True} if self.stream else None}
        if self.tools:
            body["tools"] = [chat_tool(tool) for tool in self.tools]
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        return {name: value for name, value in body.items() if value is not None}

    def response(self, completion: dict[str, Any], conversation: list[dict[str, Any]], tenant: str,
                 response_id: str | None = None, ids: ItemIds | None = None) -> tuple[dict[str, Any], StoredResponse]:
        """The response body for a chat completion of `chat_body`, and what to store of it."""
        response_id = response_id or f"resp_{uuid.uuid4().hex}"
        choice, usage = completion["choices"][0], completion["usage"]
        message = choice["message"]
        incomplete = choice["finish_reason"] == "length"
        body = {**self.skeleton(response_id, completion["created"], completion["model"]),
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output_items(message, ids or ItemIds()),
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

    def skeleton(self, response_id: str, created: int, model: str) -> dict[str, Any]:
        """A response's fields before its output: what `response.created` carries."""
        return {"id": response_id, "object": "response", "created_at": created, "model": model,
                "status": "in_progress", "incomplete_details": None, "output": [], "usage": None,
                "previous_response_id": self.previous_response_id,
                "instructions": self.instructions, "tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
                "top_p": self.top_p, "max_output_tokens": self.max_output_tokens, "store": self.store,
                "metadata": self.metadata or {}, "error": None}


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


def output_items(message: dict[str, Any], ids: ItemIds) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(_reasoning_item(ids.reasoning, message["reasoning"]))
    if message.get("content") or not message.get("tool_calls"):
        items.append(_message_item(ids.message, message.get("content") or "", "completed"))
    for index, call in enumerate(message.get("tool_calls") or ()):
        items.append(_call_item(ids.call(index), call, "completed"))
    return items


def _reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class ResponseStream:
    """A streamed chat completion's chunks as the Responses API's events (OpenAI's names and order:
    each output item added, its deltas, its done events, then `response.completed`). The reply
    accumulates into the chat message the final response is built from, with the same item ids."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request, self.ids, self.sequence = request, ItemIds(), 0
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.open: dict[str, int] = {}
        """Output index of each item opened so far, by item id."""
        self.reasoning, self.content = "", ""
        self.calls: list[dict[str, Any]] = []
        self.finish_reason, self.usage, self.created, self.model = None, None, int(time.time()), ""

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening(self, model: str) -> list[str]:
        self.model = model
        skeleton = self.request.skeleton(self.response_id, self.created, model)
        return [self.event("response.created", response=skeleton),
                self.event("response.in_progress", response=skeleton)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """One chat completion chunk's events."""
        self.usage = chunk.get("usage") or self.usage
        events: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._reasoning_delta(delta["reasoning"])
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _add(self, item_id: str, item: dict[str, Any]) -> list[str]:
        if item_id in self.open:
            return []
        self.open[item_id] = len(self.open)
        return [self.event("response.output_item.added", output_index=self.open[item_id], item=item)]

    def _reasoning_delta(self, text: str) -> list[str]:
        item_id = self.ids.reasoning
        events = self._add(item_id, _reasoning_item(item_id, None))
        self.reasoning += text
        return events + [self.event("response.reasoning_text.delta", item_id=item_id,
                                    output_index=self.open[item_id], content_index=0, delta=text)]

    def _text_delta(self, text: str) -> list[str]:
        item_id = self.ids.message
        events = self._add(item_id, _message_item(item_id, None, "in_progress"))
        if events:
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=self.open[item_id],
                                     content_index=0, part=_text_part("")))
        self.content += text
        return events + [self.event("response.output_text.delta", item_id=item_id, output_index=self.open[item_id],
                                    content_index=0, delta=text, logprobs=[])]

    def _call_delta(self, delta: dict[str, Any]) -> list[str]:
        index = delta.get("index", 0)
        while len(self.calls) <= index:
            self.calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = self.calls[index], delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["function"]["name"] += function.get("name") or ""
        item_id = self.ids.call(index)
        events = self._add(item_id, _call_item(item_id, {**call, "function": {**call["function"], "arguments": ""}},
                                               "in_progress"))
        if arguments := function.get("arguments"):
            call["function"]["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item_id,
                                     output_index=self.open[item_id], delta=arguments))
        return events

    def completion(self) -> dict[str, Any]:
        """The chat completion the stream was, as `ResponsesRequest.response` reads one."""
        message = {"role": "assistant", "content": self.content or None, "reasoning": self.reasoning or None,
                   "tool_calls": self.calls or None}
        return {"created": self.created, "model": self.model, "usage": self.usage,
                "choices": [{"message": message, "finish_reason": self.finish_reason}]}

    def closing(self, response: dict[str, Any]) -> list[str]:
        """Each open item's done events, then `response.completed` (or `.incomplete`) with `response`."""
        events = []
        for item in response["output"]:
            if item["id"] not in self.open:  # nothing streamed for it (an empty reply's message)
                events += self._add(item["id"], item)
            index = self.open[item["id"]]
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=self.reasoning))
            elif item["type"] == "message":
                events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=self.content, logprobs=[]),
                           self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_text_part(self.content))]
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response)]
