"""The OpenAI-compatible wire format: request validation in, response and SSE chunk shapes out.

Fields this server does not implement are refused by name when they ask for something (`n` > 1,
`tools`, `logprobs`, ...), never silently ignored; other unknown fields are accepted and ignored
(clients send many). `kv_transfer_params` in particular is never read: only the router's own
records decide what is pulled from where. A client-supplied `chat_template` is refused. Sampling
fields are typed here and checked by vLLM's own code in the router (app/request_check.py), not by
a copy of its rules.
"""

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.conversations import RenderMode
from app.protocol import SamplingSettings
from app.routing import RoutingPolicy

DEFAULT_MAX_TOKENS = 256
"""max_tokens of a request that names none."""
ROLES = ("system", "user", "assistant", "developer", "tool")
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "response_format", "chat_template", "best_of", "echo", "suffix", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "audio", "modalities", "prediction", "n")
"""Fields that would change the reply if honoured: refused unless absent or at a no-op value."""
NO_OP = (None, False, "", [], {})
NO_OP_BY_FIELD = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
                  "repetition_penalty": (1,), "tool_choice": ("none",), "response_format": ({"type": "text"},)}


def unsupported_fields(body: dict[str, Any]) -> list[str]:
    return [name for name in UNSUPPORTED
            if name in body and body[name] not in NO_OP + NO_OP_BY_FIELD.get(name, ())]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        kinds = {part.get("type") for part in content} - {"text"} if isinstance(content, list) else set()
        if kinds:
            raise ValueError(f"content parts of type {', '.join(sorted(map(str, kinds)))} are not supported "
                             "(this model reads text only)")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    regex: str
    """Bounded by the frontend (`limits.max_regex_bytes`), compiled by the router's check, off any event loop."""


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """vLLM's extension: sample among the k likeliest tokens (0 or -1: all)."""
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    """Within int64, as vLLM's server bounds it."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None
    """vLLM's extension: constrain the reply (here: `regex`)."""
    return_token_ids: bool = False
    """vLLM's extension: include prompt and generated token ids in the response."""
    routing_policy: RoutingPolicy | None = None
    """This project's extension: the prefill routing policy for this request (default: the config's)."""
    reverse_pull: bool | None = None
    """This project's extension: false switches the reverse KV pull off for this request only."""
    prefill_on_decode: bool | None = None
    """This project's extension: false sends this request's prompt through prefill even when it is a
    short append to a conversation a decode replica retains."""
    load_aware_placement: bool | None = None
    """This project's extension: true or false overrides `placement.load_aware` for this request."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict) and (names := unsupported_fields(body)):
            raise ValueError(f"not supported by this server: {', '.join(names)}")
        return body

    def sampling(self, default_max_tokens: int) -> SamplingSettings:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingSettings(max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
                                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                stop=stop, ignore_eos=self.ignore_eos,
                                regex=self.structured_outputs.regex if self.structured_outputs else None)

    @property
    def include_usage(self) -> bool:
        return not self.stream or bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    conversation_mode: RenderMode | None = None
    """This project's extension: how to render history for this request (default: the config's)."""

    def template_messages(self) -> list[dict[str, Any]]:
        return [{**m.model_dump(exclude_none=True), "content": m.text()} for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


class ResponseShape:
    """Builds chat or text-completion bodies and chunks for one request."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _body(self, obj: str, choice: dict[str, Any] | None, prompt_token_ids: list[int] | None = None,
              **extra: Any) -> dict[str, Any]:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice] if choice else [], **extra}
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        return body

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None,
                message_key: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice[message_key] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = finish_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
              prompt_token_ids: list[int] | None = None) -> str:
        choice = self._choice(text, finish_reason, token_ids, "delta")
        return sse(self._body(self._chunk_object, choice, prompt_token_ids))

    def usage_chunk(self, usage_body: dict[str, Any]) -> str:
        return sse(self._body(self._chunk_object, None, usage=usage_body))

    def full(self, text: str, finish_reason: str | None, usage_body: dict[str, Any],
             token_ids: list[int] | None, prompt_token_ids: list[int] | None) -> dict[str, Any]:
        choice = self._choice(text, finish_reason, token_ids, "message")
        return self._body(self.object, choice, prompt_token_ids, usage=usage_body)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"
