"""Prompt rendering: OpenAI messages or text ──chat template/tokenizer──▶ prompt token ids.

The router renders once and sends token ids onward, so prefill, decode and the KV index all see
exactly the same sequence. Two ways to render a chat turn:
- template: the whole conversation through the model's chat template;
- append:   a previous turn's recorded tokens, then the template's rendering of the new messages
            only (found by rendering the conversation with a sentinel as the last reply's text).
"""

from pathlib import Path
from typing import Any

from app.conversations import ConversationRecord
from app.openai_api import CompletionRequest

SENTINEL = "\u2063KVLOOP-REPLY-END\u2063"


class BadRequest(ValueError):
    """A client error: the router answers 400 with this message."""


class PromptRenderer:
    def __init__(self, model_path: Path, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = max_model_len

    def _render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
            raise BadRequest(f"could not render messages with the chat template: {exc}") from None

    def chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        return self.tokenizer.encode(self._render(messages, template_kwargs), add_special_tokens=False)

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
        return [*record.token_ids, *self.tokenizer.encode(tail, add_special_tokens=False)]

    def completion(self, request: CompletionRequest) -> list[int]:
        if isinstance(request.prompt, list):
            if any(t < 0 or t >= len(self.tokenizer) for t in request.prompt):
                raise BadRequest("prompt token ids must lie within the vocabulary")
            return list(request.prompt)
        return self.tokenizer.encode(request.prompt, add_special_tokens=False)

    def check_fits(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"model's context length of {self.max_model_len} tokens")
