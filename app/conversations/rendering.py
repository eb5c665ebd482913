"""Prompt rendering: OpenAI messages or text ──chat template/tokenizer──▶ prompt token ids.

The router renders once and sends token ids onward, so prefill, decode and the KV index all see
exactly the same sequence. Two ways to render a chat turn:
- template: the whole conversation through the model's chat template;
- append:   a previous turn's recorded tokens, then the template's rendering of the new messages
            only (found by rendering the conversation with a sentinel as the last reply's text).
"""

import asyncio
import inspect
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from app.conversations.openai_api import CompletionRequest
from app.conversations.records import ConversationRecord

SENTINEL = "\u2063KVLOOP-REPLY-END\u2063"


class BadRequest(ValueError):
    """A client error: the router answers 400 with this message."""


class PromptRenderer:
    def __init__(self, model_path: Path, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = max_model_len
        self.template = self.tokenizer.get_chat_template() if self.tokenizer.chat_template else None
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters
        self.server_template_args = frozenset({"messages", *parameters, *self.tokenizer.special_tokens_map})
        """What the server sets in a template: the messages, apply_chat_template's own parameters (a
        template, tools, documents, tokenization, the generation prompt) and the special tokens."""
        self.max_token_bytes = max(len(token.encode()) for token in self.tokenizer.get_vocab())
        """The most bytes one token spells: a text longer than this times the room cannot fit."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.normalizer = backend.normalizer if backend is not None else None

    def check_template_kwargs(self, template_kwargs: dict[str, Any]) -> None:
        """Only variables of the model's own template that the server does not set are taken (e.g.
        `enable_thinking`): a `chat_template` there would replace the server's template, `tools`
        extend it. vLLM's resolve_chat_template_kwargs refuses a template and tokenization and keeps
        the names the template reads (jinja2's undeclared variables) or apply_chat_template takes;
        of those, the server refuses what it sets itself."""
        from vllm.renderers.hf import resolve_chat_template_kwargs

        if not template_kwargs:
            return
        try:
            kept = resolve_chat_template_kwargs(self.tokenizer, self.template, template_kwargs) if self.template else {}
        except ValueError as exc:
            raise BadRequest(f"chat_template_kwargs: {exc}") from None
        if refused := sorted(template_kwargs.keys() - kept.keys() | template_kwargs.keys() & self.server_template_args):
            raise BadRequest(f"chat_template_kwargs: {', '.join(refused)} not accepted: only variables of this model's "
                             "chat template that the server does not set itself are")

    def _render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
            raise BadRequest(f"could not render messages with the chat template: {exc}") from None

    def _encode(self, text: str, room_tokens: int) -> list[int]:
        """`text`'s token ids; a text that cannot fit `room_tokens` is refused before the tokenizer
        spends its time on it (each token spells at most `max_token_bytes` of the normalized text)."""
        spelled = self.normalizer.normalize_str(text) if self.normalizer else text
        if len(spelled.encode()) > room_tokens * self.max_token_bytes:
            raise BadRequest(f"the prompt cannot fit the model's context length of {self.max_model_len} tokens")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        return self._encode(self._render(messages, template_kwargs), self.max_model_len)

    def append(self, record: ConversationRecord, messages: list[dict[str, Any]], last_assistant: int,
               template_kwargs: dict[str, Any]) -> list[int] | None:
        """The record's tokens followed by the rendering of everything after the last reply;
        None when the template does not render that reply verbatim (then render from scratch)."""
        marked = [*messages[:last_assistant], {"role": "assistant", "content": SENTINEL},
                  *messages[last_assistant + 1:]]
        text = self._render(marked, template_kwargs)
        if text.count(SENTINEL) != 1:
            return None
        tail = text.split(SENTINEL, 1)[1]
        eos = self.tokenizer.eos_token
        if eos and record.token_ids and record.token_ids[-1] == self.tokenizer.eos_token_id and tail.startswith(eos):
            tail = tail[len(eos):]  # the reply already ends with the end-of-turn token it generated
        return [*record.token_ids, *self._encode(tail, self.max_model_len - len(record.token_ids))]

    def completion(self, request: CompletionRequest) -> list[int]:
        if isinstance(request.prompt, list):
            if any(t < 0 or t >= len(self.tokenizer) for t in request.prompt):
                raise BadRequest("prompt token ids must lie within the vocabulary")
            return list(request.prompt)
        return self._encode(request.prompt, self.max_model_len)

    def check_fits(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"model's context length of {self.max_model_len} tokens")


async def within_budget(thread: Executor, budget_s: float, fn, *args):
    """`fn(*args)` in `thread`, given `budget_s` from when its own work starts there (not while it
    waits behind another request's): past it the client gets 400, and the thread finishes the
    work unseen (a tokenizer cannot be interrupted)."""
    loop, started = asyncio.get_running_loop(), asyncio.Event()

    def run():
        loop.call_soon_threadsafe(started.set)
        return fn(*args)

    work = loop.run_in_executor(thread, run)
    await started.wait()
    try:
        return await asyncio.wait_for(asyncio.shield(work), budget_s)
    except asyncio.TimeoutError:
        raise BadRequest(f"rendering the request took longer than this server's limit of {budget_s:g} s") from None
