"""The OpenAI wire format out: response bodies, SSE chunks, usage, errors and logprobs, shaped as vLLM's server
shapes them (its own formatters for logprobs)."""

import functools
import json
import time
from typing import Any

from app.protocol import TokenLogprobs


def logprobs_body(chat: bool, token_ids: list[int], steps: list[TokenLogprobs], top: int,
                  text_offset: int = 0) -> dict[str, Any]:
    """A choice's `logprobs` as vLLM's server writes it (its serving classes' own formatters)."""
    from vllm.logprobs import Logprob

    candidates = [{token_id: Logprob(logprob, rank, text) for token_id, logprob, rank, text in step} for step in steps]
    if chat:
        return _formatter(True)._create_chat_logprobs(token_ids, candidates, None, top).model_dump()
    return _formatter(False)._create_completion_logprobs(token_ids, candidates, top, None,
                                                         initial_text_offset=text_offset).model_dump()


@functools.cache
def _formatter(chat: bool) -> Any:
    """vLLM's serving class without a server: its logprob formatters read only this one attribute."""
    if chat:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat as Serving
    else:
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion as Serving
    formatter = object.__new__(Serving)
    formatter.return_tokens_as_token_ids = False
    return formatter


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


class ResponseShape:
    """Builds chat or text-completion bodies and chunks for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, index: int = 0) -> None:
        """`index`: the choice this shape builds (requests with `n` > 1 have one shape per choice)."""
        self.request_id, self.model, self.chat, self.index = request_id, model, chat, index
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
                message_key: str, parsed: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """`parsed`: the message or delta vLLM's parsers made of the text (app/conversations/reply_parsing.py);
        `logprobs`: logprobs_body's, when the request asked for them."""
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:  # a streamed delta names no role: the stream's first chunk did (role_chunk)
            role = {"role": "assistant"} if message_key == "message" else {}
            choice[message_key] = {**role, **parsed} if parsed is not None else {**role, "content": text}
        else:
            choice["text"] = text
        if logprobs is not None:
            choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
              prompt_token_ids: list[int] | None = None, parsed: dict[str, Any] | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed chunk's body: the chat API sends it as SSE, /v1/responses as its own events."""
        choice = self._choice(text, finish_reason, token_ids, "delta", parsed, logprobs)
        return self._body(self._chunk_object, choice, prompt_token_ids)

    def role_chunk(self, prompt_token_ids: list[int] | None) -> dict[str, Any]:
        """A chat stream's first chunk, sent at the reply's first output as vLLM's server sends it:
        the client sees the reply begin even when the parser holds back its first tokens (a tool
        call's markup), and `return_token_ids` gets the prompt's ids here."""
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._body(self._chunk_object, choice, prompt_token_ids)

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._body(self._chunk_object, None, usage=usage_body)

    def full(self, text: str, finish_reason: str | None, usage_body: dict[str, Any], token_ids: list[int] | None,
             prompt_token_ids: list[int] | None, parsed: dict[str, Any] | None = None,
             logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = self._choice(text, finish_reason, token_ids, "message", parsed, logprobs)
        return self._body(self.object, choice, prompt_token_ids, usage=usage_body)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


def merged_choices(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """One body of the choices' replies, as vLLM's server answers `n` > 1: the prompt counted once,
    the completions' tokens summed."""
    first = replies[0]
    if len(replies) == 1:
        return first
    completion = sum(reply["usage"]["completion_tokens"] for reply in replies)
    use = {**first["usage"], "completion_tokens": completion,
           "total_tokens": first["usage"]["prompt_tokens"] + completion}
    return {**first, "choices": [reply["choices"][0] for reply in replies], "usage": use}
