"""Prompt rendering: OpenAI messages or text ──chat template/tokenizer──▶ prompt token ids.

The router renders once and sends token ids onward, so prefill, decode and the KV index all see
exactly the same sequence.
"""

from pathlib import Path

from app.openai_api import ChatCompletionRequest, CompletionRequest


class BadRequest(ValueError):
    """A client error: the router answers 400 with this message."""


class PromptRenderer:
    def __init__(self, model_path: Path, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = max_model_len

    def chat(self, request: ChatCompletionRequest) -> list[int]:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **request.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
            raise BadRequest(f"could not render messages with the chat template: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

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

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)
