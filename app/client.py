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
    prompt_tokens: int


def _cached(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def chat_turn(client: OpenAI, messages: list[dict], max_tokens: int, stream: bool = True,
              model: str = "tiny-qwen3", **extra: Any) -> TurnResult:
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    kwargs = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body)
    start = time.perf_counter()
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        elapsed = time.perf_counter() - start
        choice = response["choices"][0]
        return TurnResult(response["id"], response.get("prompt_token_ids") or [], choice.get("token_ids") or [],
                          choice["message"]["content"], _cached(response["usage"]), ttft_s=elapsed, e2e_s=elapsed,
                          prompt_tokens=response["usage"]["prompt_tokens"])
    chunks, ttft = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        chunks.append(chunk.model_dump())
    deltas = [c for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    return TurnResult(chunks[0]["id"], next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), []),
                      [t for c in deltas for t in c["choices"][0].get("token_ids") or []],
                      "".join(c["choices"][0]["delta"]["content"] or "" for c in deltas), _cached(usage),
                      ttft_s=ttft if ttft is not None else time.perf_counter() - start,
                      e2e_s=time.perf_counter() - start, prompt_tokens=usage["prompt_tokens"])
