"""The OpenAI-compatible wire format: request validation in, response and SSE chunk shapes out.

Every field of vLLM's own request models (its ChatCompletionRequest and CompletionRequest) is
honoured, or refused by name when a request sets it to anything but vLLM's default (`n` > 1,
`logprobs`, ...), never silently ignored. Tools, tool_choice and response_format are honoured, and
the replies' tool calls and reasoning parsed by vLLM's own parsers (app/conversations/reply_parsing.py). The
honoured fields are typed here; the router refuses the others (app/conversations/request_check.py, which reads
the list from vLLM's models). Fields vLLM does not know are logged and ignored, as vLLM's server
does (clients send many), except a few of OpenAI's that would change the reply
(`FOREIGN_REFUSED`). `kv_transfer_params` in particular is never read: only the router's own
records decide what is pulled from where. A client-supplied `chat_template` is refused. Sampling
fields are checked by vLLM's own code in the router, not by a copy of its rules.
"""

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.config import Limits
from app.conversations.records import RenderMode
from app.protocol import SamplingSettings
from app.turn.routing import RoutingPolicy

ROLES = ("system", "user", "assistant", "developer", "tool")
NOT_IMPLEMENTED_TEXT = "tokens are returned as text (return_token_ids gives their ids)"
_ONE_CHOICE = ("choices are sampled as n turns, each kept for the conversation's next one: there is no best of "
               "them to pick; use n")
_RENDERING = "conversations are rendered append-only with the model's own chat template"
_TEXT_ONLY = "this server reads and returns text only"
REFUSED_BECAUSE = {
    "functions": "deprecated by OpenAI: use tools", "function_call": "deprecated by OpenAI: use tool_choice",
    "best_of": _ONE_CHOICE,
    "use_beam_search": "beam search is not implemented", "length_penalty": "it applies to beam search only",
    "prompt_logprobs": "a prompt's history is mostly not computed at all (its KV is reused), so it has none",
    "logprob_token_ids": "not implemented: top_logprobs is", "return_tokens_as_token_ids": NOT_IMPLEMENTED_TEXT,
    "chat_template": "a client's template is not run",
    "add_generation_prompt": _RENDERING, "continue_final_message": _RENDERING, "add_special_tokens": _RENDERING,
    "documents": _RENDERING,
    "reasoning_effort": "the model's template takes chat_template_kwargs (enable_thinking)",
    "include_reasoning": "reasoning is returned apart whenever the config names a reasoning_parser",
    "thinking_token_budget": "not implemented",
    "echo": "the prompt is not echoed", "suffix": "not implemented",
    "truncate_prompt_tokens": "prompts are not truncated", "truncation_side": "prompts are not truncated",
    "media_io_kwargs": _TEXT_ONLY, "mm_processor_kwargs": _TEXT_ONLY, "mm_payload": _TEXT_ONLY,
    "return_mm_kwargs": _TEXT_ONLY, "prompt_embeds": _TEXT_ONLY, "audio": _TEXT_ONLY, "modalities": _TEXT_ONLY,
    "prediction": "predicted outputs are not implemented",
    "priority": "this server sets priorities itself (later turns first)",
    "request_id": "this server names its requests", "cache_salt": "this server salts the prefix cache per tenant",
    "vllm_xargs": "no custom extension runs here",
    "repetition_detection": "not implemented", "watermarking": "not implemented",
    "stream_interval": "chunks stream as the engines produce them",
    "routed_experts_prompt_start": "expert routing is not returned", "return_token_offsets": "not returned",
    "return_prompt_text": "not returned",
}
"""Why a field the server does not honour is refused (a vLLM field not listed: `NOT_IMPLEMENTED`)."""
NOT_IMPLEMENTED = "not implemented"
FOREIGN_REFUSED = ("functions", "function_call", "audio", "modalities", "prediction", "best_of")
"""OpenAI's fields that vLLM's models lack and that would change the reply: refused all the same."""
IGNORED = ("kv_transfer_params", "ec_transfer_params")
"""vLLM fields dropped from every request as it is read: only the router's own records decide what
is transferred from where."""
ASKS_NOTHING = {"response_format": ({"type": "text"},), "text": ({"format": {"type": "text"}},)}
"""Values, besides vLLM's default, null and empty ones, that ask for nothing."""


def asks_nothing(name: str, value: Any, default: Any) -> bool:
    """Whether `value` of a field this server does not honour asks for nothing: vLLM's default
    (`default`), null, empty, or false where vLLM's default is null."""
    if value is None or (isinstance(value, (str, list, dict)) and not value) or value in ASKS_NOTHING.get(name, ()):
        return True
    if value is False and default is None:
        return True
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def refused_fields(extra: dict[str, Any], vllm_defaults: dict[str, Any]) -> str | None:
    """The message refusing the fields in `extra` (those this server's models do not declare) that
    vLLM's request model declares (`vllm_defaults`: name to default) or `FOREIGN_REFUSED` names,
    set to anything that asks for something; None if there is none."""
    refused = [name for name, value in extra.items()
               if (name in vllm_defaults or name in FOREIGN_REFUSED) and name not in IGNORED
               and not asks_nothing(name, value, vllm_defaults.get(name))]
    if not refused:
        return None
    reasons = (f"{name} ({REFUSED_BECAUSE.get(name, NOT_IMPLEMENTED)})" for name in sorted(refused))
    return f"not supported by this server: {', '.join(reasons)}"


def _refuse_extra(model: BaseModel, prefix: str) -> None:
    """For a nested object: refuse the keys it does not declare that ask for something."""
    if asked := [name for name, value in (model.model_extra or {}).items() if not asks_nothing(name, value, None)]:
        raise ValueError(f"not supported by this server: {', '.join(f'{prefix}.{n}' for n in sorted(asked))}")


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """vLLM's name for reasoning_content; either is rendered (the template reads reasoning_content)."""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

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
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False

    @model_validator(mode="after")
    def _nothing_else(self) -> "StreamOptions":
        _refuse_extra(self, "stream_options")  # continuous_usage_stats
        return self


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="allow")
    regex: str
    """Bounded by the frontend (`limits.max_regex_bytes`), compiled by the router's check, off any event loop."""

    @model_validator(mode="after")
    def _nothing_else(self) -> "StructuredOutputs":
        _refuse_extra(self, "structured_outputs")  # json, choice, grammar, ...: only regex is implemented
        return self


class GenerationRequest(BaseModel):
    # Undeclared fields are kept (`model_extra`) for the router's check, which refuses vLLM's
    # fields this server does not honour and ignores the rest, as vLLM does.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """vLLM's extension: sample among the k likeliest tokens (0 or -1: all)."""
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    """Within int64, as vLLM's server bounds it."""
    n: int = Field(default=1, ge=1)
    """Choices: each a turn of its own (choices()), its reply's KV kept for whichever the client continues."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None
    """vLLM's extension: constrain the reply (here: `regex`)."""
    return_token_ids: bool = False
    """vLLM's extension: include prompt and generated token ids in the response."""
    response_format: dict[str, Any] | None = None
    """text, json_object or json_schema (its `schema`), as vLLM maps them to structured outputs."""
    # vLLM's sampling extensions and OpenAI's penalties, typed as vLLM's models type them; their
    # values are checked by vLLM's SamplingParams in the router.
    min_tokens: int = 0
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    session_id: str | None = None
    """vLLM's extension: a chat's conversation identity, before the X-Session-ID header as in vLLM."""
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
    def _drop_ignored(cls, body: Any) -> Any:
        if isinstance(body, dict) and not body.keys().isdisjoint(IGNORED):
            return {name: value for name, value in body.items() if name not in IGNORED}
        return body

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        response_grammar(response_format)
        return response_format

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self, default_max_tokens: int, defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingSettings:
        """`defaults`: the model's generation config (vLLM's get_diff_sampling_param), for the fields
        the client did not set, as vLLM's server applies it."""
        allowed, given = self.allowed_token_ids, self.model_fields_set

        def chosen(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return value if name in given and value is not None else defaults.get(name, neutral)

        return SamplingSettings(max_tokens=self.requested_max_tokens or default_max_tokens,
                                temperature=chosen("temperature", 1.0), top_p=chosen("top_p", 1.0),
                                top_k=chosen("top_k", 0), seed=self.seed,
                                stop=self.stop_strings, ignore_eos=self.ignore_eos,
                                regex=self.structured_outputs.regex if self.structured_outputs else None,
                                **response_grammar(self.response_format),
                                min_tokens=self.min_tokens, min_p=chosen("min_p", 0.0),
                                presence_penalty=chosen("presence_penalty", 0.0),
                                frequency_penalty=chosen("frequency_penalty", 0.0),
                                repetition_penalty=chosen("repetition_penalty", 1.0),
                                stop_token_ids=tuple(self.stop_token_ids or ()), bad_words=tuple(self.bad_words or ()),
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                logit_bias=tuple((self.logit_bias or {}).items()),
                                allowed_token_ids=None if allowed is None else tuple(allowed),
                                skip_special_tokens=self.skip_special_tokens,
                                spaces_between_special_tokens=self.spaces_between_special_tokens,
                                logprobs=self.sample_logprobs)

    def over_limits(self, limits: Limits) -> str | None:
        """What in the request exceeds the server's bounds on work a field can ask of an engine:
        a grammar's compile time grows faster than its regex, and vLLM checks every stop string
        against every new token's text and applies every token rule at every step."""
        if self.n > limits.max_choices:
            return f"n: {self.n} choices exceed this server's limit of {limits.max_choices}"
        regex_bytes = len(self.structured_outputs.regex.encode()) if self.structured_outputs else 0
        if regex_bytes > limits.max_regex_bytes:
            return (f"structured_outputs.regex: {regex_bytes} bytes exceed this server's limit of "
                    f"{limits.max_regex_bytes}")
        stop = self.stop_strings
        if len(stop) > limits.max_stop_strings:
            return f"stop: {len(stop)} strings exceed this server's limit of {limits.max_stop_strings}"
        if longest := max((len(s) for s in stop if len(s) > limits.max_stop_chars), default=0):
            return f"stop: a string of {longest} characters exceeds this server's limit of {limits.max_stop_chars}"
        for name in ("stop_token_ids", "bad_words", "logit_bias"):
            if len(getattr(self, name) or ()) > limits.max_token_rules:
                return f"{name}: more than this server's limit of {limits.max_token_rules} entries"
        return None

    def choices(self) -> list["GenerationRequest"]:
        """One request per choice, as vLLM splits `n` (its parallel sampling): choice i samples with
        seed + i, and streams without usage, which the merged stream reports once."""
        update: dict[str, Any] = {"n": 1, "stream_options": None} if self.stream else {"n": 1}
        return [self.model_copy(update={**update, "seed": None if self.seed is None else self.seed + i})
                for i in range(self.n)]

    @property
    def may_call_tools(self) -> bool:
        """Whether the reply may end in tool calls (a chat request offering tools)."""
        return False

    @property
    def sample_logprobs(self) -> int | None:
        """vLLM's SamplingParams.logprobs: candidates per token besides the sampled one; None: none."""
        return None

    @property
    def include_usage(self) -> bool:
        return not self.stream or bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    """Checked by vLLM's own request model in the router (app/conversations/request_check.py), rendered by the
    template."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    conversation_mode: RenderMode | None = None
    """This project's extension: how to render history for this request (default: the config's)."""
    logprobs: bool = False
    top_logprobs: int | None = 0

    @model_validator(mode="before")
    @classmethod
    def _vllm_logprob_checks(cls, body: Any) -> Any:
        return vllm_logprob_checks(body, chat=True)

    @property
    def may_call_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def conversation_opening(self) -> str:
        """The messages up to and including the first user message, which every later turn resends."""
        first_user = next((i for i, m in enumerate(self.messages) if m.role == "user"), 0)
        return "\x00".join(f"{m.role}:{m.text()}" for m in self.messages[:first_user + 1])

    def template_messages(self) -> list[dict[str, Any]]:
        messages = []
        for m in self.messages:
            message = {**m.model_dump(exclude_none=True, exclude={"reasoning"}), "content": m.text()}
            if m.reasoning is not None and m.reasoning_content is None:
                message["reasoning_content"] = m.reasoning
            messages.append(message)
        return messages


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """A batch of one is its prompt; a batch of more is refused: each prompt is a turn of its own
        (its own placement, KV and record), so a client sends one request each."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise ValueError(f"a list of {len(prompt)} prompts is not supported by this server: send one "
                                 "request per prompt")
            return prompt[0]
        return prompt

    @model_validator(mode="before")
    @classmethod
    def _vllm_logprob_checks(cls, body: Any) -> Any:
        return vllm_logprob_checks(body, chat=False)

    @property
    def conversation_opening(self) -> str:
        """The prompt's start, which a client continuing it resends."""
        return str(self.prompt[:64] if isinstance(self.prompt, list) else self.prompt[:256])

    @property
    def sample_logprobs(self) -> int | None:
        return self.logprobs


def vllm_logprob_checks(body: Any, chat: bool) -> Any:
    """vLLM's own request checks of the logprob fields (top_logprobs needs logprobs, -1 or >= 0, ...),
    run only when a request sets one (they import vLLM's request models)."""
    if not isinstance(body, dict) or body.keys().isdisjoint(("logprobs", "top_logprobs", "prompt_logprobs")):
        return body
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VLLMRequest
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VLLMRequest
    from vllm.exceptions import VLLMValidationError

    try:
        return VLLMRequest.check_logprobs(body)
    except VLLMValidationError as exc:  # not a ValueError: pydantic would not make it a 400
        raise ValueError(str(exc)) from None


def response_grammar(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """SamplingSettings' grammar for `response_format`, as vLLM's structured_outputs_from_response_format
    maps it (text: none)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: a JSON schema object is required")
        return {"json_schema": json.dumps(schema)}
    if kind != "text":
        raise ValueError(f"response_format.type: {kind!r} is not supported (text, json_object, json_schema)")
    return {}


