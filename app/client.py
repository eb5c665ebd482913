"""A small OpenAI-client driver for conversations against the router: tests, benchmarks, notebooks.

Greedy turns with token ids (vLLM's return_token_ids extension) and client-side timings.
"""

import time
from dataclasses import dataclass
from typing import Any

from openai import OpenAI


@dataclass
class TurnResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    cached_tokens: int
    ttft_s: float
    e2e_s: float

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def chat_turn(client: OpenAI, messages: list[dict], max_tokens: int, stream: bool = True,
              model: str = "tiny-qwen3", **extra: Any) -> TurnResult:
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    kwargs = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body)
    start = time.perf_counter()
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        elapsed = time.perf_counter() - start
        choice = response["choices"][0]
        return TurnResult(response["id"], response["prompt_token_ids"], choice["token_ids"],
                          choice["message"]["content"], response["usage"]["prompt_tokens_details"]["cached_tokens"],
                          ttft_s=elapsed, e2e_s=elapsed)
    chunks, ttft = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        chunks.append(chunk.model_dump())
    deltas = [c for c in chunks if c["choices"]]
    return TurnResult(chunks[0]["id"], chunks[0]["prompt_token_ids"],
                      [t for c in deltas for t in c["choices"][0]["token_ids"]],
                      "".join(c["choices"][0]["delta"]["content"] or "" for c in deltas),
                      chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"],
                      ttft_s=ttft if ttft is not None else time.perf_counter() - start,
                      e2e_s=time.perf_counter() - start)
