"""Tool calls and reasoning, told apart from a reply's content by vLLM's own parsers, as vLLM's chat
server does (its Parser: the tool parser and reasoning parser the config names).

    router:   body ──vllm_request()──▶ vLLM's ChatCompletionRequest (its checks of tools, tool_choice)
                   ──constrain()──▶ SamplingSettings with the structural tag and skip_special_tokens
                                    vLLM's parser asks for (a `required` or named tool choice)
              finished reply ──message()──▶ the assistant message the client replays (the record's key)
    frontend: each chunk ──StreamParser.delta()──▶ vLLM's DeltaMessage (streamed), or message() once
The streaming state lives in the frontend, which outlives a router replica dying under a reply.
"""

import json
from dataclasses import replace
from typing import Any

from app.config import TINY_MODEL, AppConfig
from app.conversations.memo import Memo
from app.conversations.openai_api import ChatCompletionRequest
from app.conversations.rendering import BadRequest
from app.engine.adapter import structured_outputs
from app.model.tiny import ensure_tiny_model
from app.protocol import SamplingSettings

REQUEST_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "stream")
"""What vLLM's parser reads of a request."""


class ReplyParsing:
    """vLLM's parser class for the model family, built once per replica."""

    @classmethod
    def of(cls, config: AppConfig, tokenizer: Any = None) -> "ReplyParsing":
        if tokenizer is None:
            from transformers import AutoTokenizer

            if config.model == TINY_MODEL:
                ensure_tiny_model(config.model_path())
            tokenizer = AutoTokenizer.from_pretrained(str(config.model_path()))
        return cls(tokenizer, config.tool_call_parser, config.reasoning_parser, config.model_name,
                   config.tool_strict_level, config.limits.remembered_grammars)

    def __init__(self, tokenizer: Any, tool_call_parser: str, reasoning_parser: str, model_name: str,
                 tool_strict_level: str, remembered: int) -> None:
        from vllm.parser import ParserManager

        self.tokenizer, self.auto_tools = tokenizer, bool(tool_call_parser)
        self.constraints: Memo[dict[str, Any]] = Memo(remembered)
        """constrain()'s result by what it reads of a request: the same every turn of an agent loop."""
        self.reasoning = bool(reasoning_parser)
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_call_parser or None, reasoning_parser_name=reasoning_parser or None,
            enable_auto_tools=self.auto_tools, model_name=model_name, tool_strict_level=tool_strict_level,
            tokenizer=tokenizer)

    def applies(self, body: ChatCompletionRequest) -> bool:
        """Whether a reply to `body` is parsed: it offers tools, or a reasoning parser runs."""
        return self.parser_cls is not None and (self.reasoning or bool(body.tools))

    def vllm_request(self, body: ChatCompletionRequest):
        """vLLM's own request model for `body`: its validation of tools and tool_choice (400 naming
        the field), and what its parsers read."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VLLMRequest
        from vllm.exceptions import VLLMClientError

        fields = body.model_dump(include=set(REQUEST_FIELDS), exclude_none=True)
        try:
            request = VLLMRequest.model_validate({"model": body.model or "", **fields})
        except (ValueError, VLLMClientError) as exc:
            raise BadRequest(f"invalid request: {exc}") from None
        if request.tools and request.tool_choice != "none" and not self.auto_tools:
            raise BadRequest("tools: this server's config names no tool_call_parser (tool_choice \"none\" only)")
        return request

    def _parser(self, request):
        return self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs=request.chat_template_kwargs or {},
                               model_config=None)

    def constrain(self, body: ChatCompletionRequest, sampling: SamplingSettings) -> SamplingSettings:
        """The sampling vLLM's parser asks for: its structural tag for the tool calls the request
        allows (with an `auto` choice and a structured output, a tag that admits either, as vLLM
        merges them), special tokens kept where the parser reads them. A `required` or named choice
        forces a call, and vLLM's server then drops the structured output with a warning: refused
        here, since the client would get a 200 that ignored what it asked."""
        if body.tools is None and body.tool_choice is None and not self.reasoning:
            return sampling
        # vLLM's parsers adjust a request from these fields, never from its messages
        read = body.model_dump(mode="json", include=set(REQUEST_FIELDS) - {"messages"}, exclude_none=True)
        # in the request's own order: vLLM's tag keeps a schema's property order
        key = json.dumps([read, sampling.grammar_spec])
        return replace(sampling, **self.constraints.get_or_make(key, lambda: self._constraint(body, sampling)))

    def _constraint(self, body: ChatCompletionRequest, sampling: SamplingSettings) -> dict[str, Any]:
        request = self.vllm_request(body)
        if self.parser_cls is None:
            return {}
        request.structured_outputs = asked = structured_outputs(sampling)
        request = self._parser(request).adjust_request(request=request)
        grammar = request.structured_outputs
        if asked is not None and grammar is not asked and _named_or_required(request):
            raise BadRequest("tool_choice: a required or named tool choice forces a tool call, which vLLM's server "
                             "answers ignoring structured_outputs and response_format: send one or the other")
        if grammar is None or grammar is asked:
            return {"skip_special_tokens": request.skip_special_tokens}
        schema = grammar.json
        return {"skip_special_tokens": request.skip_special_tokens, "regex": grammar.regex,
                "json_schema": json.dumps(schema) if isinstance(schema, dict) else schema,
                "json_object": bool(grammar.json_object), "structural_tag": grammar.structural_tag}

    def message(self, request, text: str, token_ids: list[int]) -> tuple[dict[str, Any], bool]:
        """The assistant message of a finished reply as vLLM's server returns it, and whether it
        called tools (finish_reason "tool_calls" for auto and required choices)."""
        from vllm.renderers.chat_utils import make_tool_call_id

        reasoning, content, calls = self._parser(request).parse(text, request, enable_auto_tools=self.auto_tools,
                                                               model_output_token_ids=token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning"] = reasoning
        if calls and request.tool_choice != "none":
            message["tool_calls"] = [{"id": call.id or make_tool_call_id(), "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
            if message["content"] is None and _named_or_required(request):
                message["content"] = ""
        return message, "tool_calls" in message and not _named(request)

    def replayed(self, body: ChatCompletionRequest, text: str, token_ids: list[int]) -> dict[str, Any]:
        """The reply as the client will replay it in the next turn's history (its record's key)."""
        if self.applies(body):
            return self.message(self.vllm_request(body), text, token_ids)[0]
        return {"role": "assistant", "content": text}

    def stream(self, request) -> "StreamParser":
        return StreamParser(self._parser(request), request)


class StreamParser:
    """One streamed reply's parsing state (vLLM's parser is stateful: one per reply)."""

    def __init__(self, parser: Any, request: Any) -> None:
        self.parser, self.request = parser, request
        self.called_tools = False

    def delta(self, text: str, token_ids: list[int], prompt_token_ids: list[int], finished: bool) -> dict | None:
        """This chunk's delta as vLLM streams it (content, reasoning, tool_calls), or None."""
        delta = self.parser.parse_delta(delta_text=text, delta_token_ids=token_ids, request=self.request,
                                        prompt_token_ids=prompt_token_ids, finished=finished)
        if delta is None:
            return None
        body = delta.model_dump(exclude_none=True)
        self.called_tools = self.called_tools or bool(body.get("tool_calls"))
        return body

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.called_tools and engine_reason == "stop" and not _named(self.request):
            return "tool_calls"
        return engine_reason


def _named(request) -> bool:
    return isinstance(request.tool_choice, dict) or hasattr(request.tool_choice, "function")


def _named_or_required(request) -> bool:
    return _named(request) or request.tool_choice == "required"
